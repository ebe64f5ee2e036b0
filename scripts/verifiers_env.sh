#!/usr/bin/env bash
# Build `.venv-verifiers` for the lane `make test-verifiers`: fleetrl with its `verifiers` extra (verifiers 0.4.0
# pulls ~100 packages: mcp, anthropic, prime-*; it is never a core dependency) and the test tools, CPU torch 2.13.0.
#   bash scripts/verifiers_env.sh     # a no-op when up to date; fails loudly when an install fails
# VENV=.venv-verifiers PYTHON=python3 by default. Re-run after pyproject.toml changes (the stamp says).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-verifiers}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
STAMP="$VENV/.installed-$(cat pyproject.toml scripts/verifiers_env.sh | cksum | cut -d' ' -f1)"
[ -f "$STAMP" ] && exit 0

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "verifiers 0.4.0 needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
DS_BUILD_OPS=0 "$PY" -m pip install -q "torch==2.13.0" -e '.[verifiers]' "pytest>=8" "pytest-timeout>=2.3"
"$PY" -c 'import torch, verifiers, verifiers.v1; print("torch", torch.__version__, "verifiers", verifiers.__version__)'
rm -f "$VENV"/.installed-* && touch "$STAMP"
