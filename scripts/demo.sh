#!/usr/bin/env bash
# The demo: build a tiny model and the arithmetic data, then (once the launcher lands) train it.
set -euo pipefail
mkdir -p models data
fleetrl init-model --out models/demo --preset small
fleetrl init-data --task arithmetic --out data/arith.jsonl --n 20000 --eval-n 500
echo "The RL loop (broker, rollout, learner, fleetrl run) is not built yet: nothing was trained." >&2
exit 1
