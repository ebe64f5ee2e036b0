#!/usr/bin/env bash
# The multi-turn demo: a ~1.2M-parameter model learns to use a `calc` tool for products of two-digit numbers.
#   model + data -> warm start on tool conversations (~20% held-out episode success) -> eval
#   -> `fleetrl run configs/multiturn.yaml` (RL, 5 min) -> eval -> report (success, turns, well-formed calls)
# `--endpoint`: the same job with rollout.env.type=openai, driven by scripts/multiturn_agent.py (openai client).
# Re-running reuses models/ and data/ (delete them to start from scratch). RUN=dir names the run directory;
# RL_ARGS="key=value ..." adds overrides to the RL run (e.g. RL_ARGS="learner.lr=1e-4"); AGENT_WORKERS: the
# agent's concurrent sessions (default 128 = prompts_per_batch x group_size, the tool env's episodes in flight);
# BEFORE=eval.json reuses an earlier greedy eval of the same warm start instead of evaluating again.
# benchmarks/multiturn_demo.py runs both modes and saves the figures with the machine's load.
set -euo pipefail
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)  # scripts/ (the agent and the report), wherever the demo runs
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
ENDPOINT=0; [ "${1:-}" = "--endpoint" ] && ENDPOINT=1
SECONDS=0

step "1/6 model and data (built locally, no hub)"
[ -f models/multiturn/config.json ] || fleetrl init-model --out models/multiturn --preset small
[ -f data/calc.eval.jsonl ] || fleetrl init-data --task calc --out data/calc.jsonl --n 20000 --eval-n 500

step "2/6 warm start on tool conversations, stopped at ~20% held-out episode success"
[ -f models/multiturn-warm/config.json ] || fleetrl sft --model models/multiturn --data data/calc.jsonl \
    --eval-data data/calc.eval.jsonl --out models/multiturn-warm --target-acc 0.2 --lr 2e-4 --eval-every 10 \
    --eval-n 100 --max-minutes 30 --threads "$(nproc)" --config configs/multiturn.yaml

RUN=${RUN:-"runs/multiturn$([ $ENDPOINT = 1 ] && echo -endpoint)-$(date +%Y%m%d-%H%M%S)"}
mkdir -p "$RUN"
step "3/6 held-out episode success before RL (500 problems never trained on)"
if [ -n "${BEFORE:-}" ]; then cp "$BEFORE" "$RUN/eval-before.json"  # the same warm start's greedy eval, reused
else fleetrl eval --config configs/multiturn.yaml --model models/multiturn-warm --data data/calc.eval.jsonl --k 0 \
    --out "$RUN/eval-before.json"; fi

if [ $ENDPOINT = 1 ]; then
  step "4/6 RL through the OpenAI endpoint: fleetrl run (rollout.env.type=openai) + an openai-client agent"
  fleetrl run --config configs/multiturn.yaml --run-dir "$RUN" --no-status rollout.env.type=openai \
      rollout.openai.enabled=true rollout.openai.port=0 run.eval_interval=0 \
      rollout.openai.max_sessions_per_client="${AGENT_WORKERS:-128}" ${RL_ARGS:-} &
  RUN_PID=$!
  while [ ! -f "$RUN/rollout-0.openai.json" ]; do sleep 1; kill -0 $RUN_PID; done
  ROOT=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['base_url'][:-3])" "$RUN/rollout-0.openai.json")
  $PY "$HERE/multiturn_agent.py" --server "$ROOT" --workers "${AGENT_WORKERS:-128}" --out "$RUN/agent.jsonl" &
  AGENT_PID=$!
  wait $RUN_PID
  wait $AGENT_PID || true
else
  step "4/6 RL: fleetrl run configs/multiturn.yaml (broker + rollout server + learner, 5 minutes)"
  fleetrl run --config configs/multiturn.yaml --run-dir "$RUN" ${RL_ARGS:-}
fi

step "5/6 held-out episode success after RL"
FINAL=$(ls -d "$RUN"/checkpoints/step-*/hf | tail -n 1)
fleetrl eval --config configs/multiturn.yaml --model "$FINAL" --data data/calc.eval.jsonl --k 0 --out "$RUN/eval-after.json"

step "6/6 report"
fleetrl report "$RUN" || true
$PY "$HERE/multiturn_report.py" "$RUN"
echo "demo finished in ${SECONDS} s"
