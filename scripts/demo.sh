#!/usr/bin/env bash
# `make demo`: a ~1.2M-parameter model learns two-number addition from a checker alone, on CPU.
#   model + data -> supervised warm start to ~25% -> eval -> `fleetrl run` (RL, 5 min) -> eval -> report
# Re-running reuses models/ and data/ (delete them to start from scratch).
set -euo pipefail
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
SECONDS=0

step "1/6 model and data (built locally, no hub)"
[ -f models/demo/config.json ] || fleetrl init-model --out models/demo --preset small
[ -f data/arith.eval.jsonl ] || fleetrl init-data --task arithmetic --out data/arith.jsonl --n 20000 --eval-n 500

step "2/6 supervised warm start, stopped at ~25% held-out accuracy"
[ -f models/demo-warm/config.json ] || fleetrl sft --model models/demo --data data/arith.jsonl \
    --eval-data data/arith.eval.jsonl --out models/demo-warm --target-acc 0.25 --threads "$(nproc)"

RUN="runs/demo-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$RUN"
step "3/6 held-out accuracy before RL (500 problems never trained on)"
fleetrl eval --config configs/demo.yaml --model models/demo-warm --data data/arith.eval.jsonl --out "$RUN/eval-before.json"

step "4/6 RL: fleetrl run configs/demo.yaml (broker + rollout server + learner, 5 minutes)"
fleetrl run --config configs/demo.yaml --run-dir "$RUN"

step "5/6 held-out accuracy after RL"
FINAL=$(ls -d "$RUN"/checkpoints/step-*/hf | tail -n 1)
fleetrl eval --config configs/demo.yaml --model "$FINAL" --data data/arith.eval.jsonl --out "$RUN/eval-after.json"

step "6/6 report"
fleetrl report "$RUN"
python - "$RUN" <<'PY'
import json, sys
run = sys.argv[1]
acc = lambda f: json.load(open(f"{run}/{f}"))["metrics"]["eval/accuracy"]
before, after = acc("eval-before.json"), acc("eval-after.json")
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
curve = [(r["step"], r["time"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
t0 = curve[0][1] if curve else 0
print("\nheld-out greedy accuracy during RL (in-process eval, 500 problems):")
for step, t, a in curve[:: max(1, len(curve) // 12)] + curve[-1:]:
    print(f"  step {step:5d}  {t - t0:6.0f} s  {100 * a:5.1f}%  " + "#" * int(60 * a))
print(f"\nbefore RL {100 * before:.1f}%  ->  after RL {100 * after:.1f}%  ({100 * (after - before):+.1f} points)")
print(f"report: {run}/report.html")
PY
echo "demo finished in ${SECONDS} s"
