#!/usr/bin/env bash
# GPU check of the vLLM engine (docs/gpu.md): builds (or reuses) the GPU environment with vLLM 0.33
# (CUDA), then, as one prepared run:
#   1. the vLLM lane's tests on the GPU: tests/vllm with FLEETRL_VLLM_DEVICE=cuda (log-probs against HF,
#      greedy equality after an update received in the worker, stops, seeds, mid-request version
#      switch, bad updates refused, `fleetrl run` with rollout.engine=vllm learning the demo task);
#   2. engine tokens/s (the streaming suite) against `vllm bench throughput` on the same model and lengths;
#   3. the in-flight update of a 0.5B-shaped model (preset q05b): NCCL from a publisher on a second
#      GPU into the vLLM worker when two GPUs are visible, else gloo into the CUDA worker (said so).
# Figures go to $OUT (default gpu-check-out/).
#
#   bash scripts/gpu_check.sh                  # VENV=.venv-gpu PYTHON=python3 by default
#   SKIP_INSTALL=1 bash scripts/gpu_check.sh   # reuse an environment built before
#   SKIP_TESTS=1 / SKIP_BENCH=1                # one half only
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed); nothing to check here" >&2
    exit 2
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
GPUS=$(nvidia-smi -L | wc -l)

if [ -z "${SKIP_INSTALL:-}" ]; then
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # 1. vLLM first: it brings the CUDA build of torch it was compiled against.
    "$PY" -m pip install -q 'vllm==0.33.0'
    # 2. fleetrl and its other deps with torch held at vLLM's version (its CPU pin would replace it).
    "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$VENV/torch-constraint.txt"
    DS_BUILD_OPS=0 "$PY" -m pip install -q -c "$VENV/torch-constraint.txt" -e . pytest pytest-timeout
fi
"$PY" -c 'import torch, vllm, transformers; print(f"torch {torch.__version__} (cuda {torch.version.cuda}), vllm {vllm.__version__}, transformers {transformers.__version__}, gpu: {torch.cuda.get_device_name(0)}")' | tee "$OUT/versions.txt"

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
    FLEETRL_VLLM_LANE=1 FLEETRL_VLLM_DEVICE=cuda timeout "${GPU_CHECK_TIMEOUT:-900}" \
        "$PY" -m pytest -q tests/vllm -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.txt" || status=1
fi

if [ -z "${SKIP_BENCH:-}" ]; then
    MODELS=$(mktemp -d)
    "$VENV/bin/fleetrl" init-model --out "$MODELS/small" --preset small
    # 2. our engine (streaming, the long-tail suite on GPU) and vLLM's own benchmark on the same model
    "$PY" benchmarks/engine_throughput.py --suite streaming --engine vllm --device cuda --presets small \
        --batch-prompts 64 --n 8 --total-prompts 256 --long-tokens 256 --short-tokens 256 --long-frac 1 \
        --updates 3 --out "$OUT/engine_streaming_gpu.json" 2>&1 | tail -n 5 | tee "$OUT/engine.txt" || status=1
    "$VENV/bin/vllm" bench throughput --model "$MODELS/small" --dtype float32 --input-len 8 --output-len 256 \
        --num-prompts 2048 --max-model-len 512 2>&1 | tail -n 5 | tee "$OUT/vllm_bench.txt" || status=1
    # 3. the in-flight update of a 0.5B-shaped model
    if [ "$GPUS" -ge 2 ]; then
        transport=(--transport nccl --learner-device cuda:1)
    else
        echo "one GPU: NCCL refuses two ranks on one device; timing gloo into the CUDA worker instead" | tee "$OUT/update.txt"
        transport=(--transport gloo --learner-device cpu)
    fi
    "$PY" benchmarks/engine_throughput.py --suite streaming --engine vllm --device cuda --dtype bfloat16 \
        --presets q05b --updates 3 "${transport[@]}" --out "$OUT/update_q05b.json" 2>&1 | tail -n 4 \
        | tee -a "$OUT/update.txt" || status=1
fi
exit $status
