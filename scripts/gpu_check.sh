#!/usr/bin/env bash
# GPU check: build (or reuse) the GPU environment with vLLM, build a small model locally and run
# the GPU tests (`pytest -m gpu tests/gpu`): the vllm engine's groups, log-probs against a float32
# HF forward, stops, seeds and weight updates. See docs/gpu.md.
#
#   bash scripts/gpu_check.sh                  # VENV=.venv-gpu PYTHON=python3 by default
#   SKIP_INSTALL=1 bash scripts/gpu_check.sh   # reuse an environment built before
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed); nothing to check here" >&2
    exit 2
fi
nvidia-smi -L

if [ -z "${SKIP_INSTALL:-}" ]; then
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # 1. vLLM first: it brings the CUDA build of torch it was compiled against.
    "$PY" -m pip install -q 'vllm==0.33.0'
    # 2. fleetrl without resolving its deps (its CPU torch pin would replace vLLM's torch), then
    #    its other deps, with torch held at vLLM's version.
    "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$VENV/torch-constraint.txt"
    "$PY" -m pip install -q --no-deps -e .
    "$PY" -m pip install -q -c "$VENV/torch-constraint.txt" 'transformers>=5.16.1,<5.21' deepspeed==0.19.8 \
        pyzmq msgspec uvloop opentelemetry-sdk opentelemetry-exporter-otlp-proto-http safetensors datasets \
        pyyaml rich math-verify matplotlib peft psutil pytest pytest-timeout
fi
"$PY" -c 'import torch, vllm, transformers; print(f"torch {torch.__version__} (cuda {torch.version.cuda}), vllm {vllm.__version__}, transformers {transformers.__version__}, gpu: {torch.cuda.get_device_name(0)}")'

# The test model, built locally: the small preset (vLLM's attention kernels want head size >= 32).
MODEL_DIR=$(mktemp -d)/small
"$VENV/bin/fleetrl" init-model --out "$MODEL_DIR" --preset small
export FLEETRL_GPU_MODEL_DIR=$MODEL_DIR

# A few minutes: two vLLM start-ups (enforce_eager) and a handful of short generations.
timeout "${GPU_CHECK_TIMEOUT:-900}" "$PY" -m pytest -q -m gpu tests/gpu -rs -s "$@"
