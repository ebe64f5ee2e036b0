#!/usr/bin/env bash
# The verifiers trial (issue 18, docs/environments.md#verifiers): a small local verifiers 0.4 taskset
# (fleet_calc/) evaluated against the fleetrl endpoint, in a throwaway venv (verifiers is not a project
# dependency: it pulls ~100 packages, mcp, anthropic and transformers among them, and its chat harness
# `uv sync`s its own script environment from the package index on first use).
#   1. inference: vf-eval with the `null` harness (the chat program; it always streams) on the subprocess
#      runtime against an inference-only endpoint;
#   2. training: one session opened with POST /fleetrl/sessions, vf-eval pointed at the session's base URL
#      (rollout.openai.session_header renamed: verifiers sends its own X-Session-ID on every call), the
#      session closed with a reward; the episode fleetrl would train is printed.
# Run from the repository root: bash scripts/verifiers_trial/run.sh   (VENV=/tmp/vf-venv to reuse one)
set -euo pipefail
export HF_HUB_OFFLINE=1
ROOT=$(pwd); HERE="$ROOT/scripts/verifiers_trial"; VENV=${VENV:-/tmp/vf-venv}; WORK=$(mktemp -d)
[ -x "$VENV/bin/vf-eval" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "verifiers==0.4.0" uv; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
serve() {  # serve.py OUT [args]: start, wait for its address file
  "$ROOT/.venv/bin/python" "$HERE/serve.py" "$@" > "$WORK/$(basename "$1").log" 2>&1 &
  PIDS+=($!)
  while [ ! -s "$1" ]; do sleep 1; kill -0 "${PIDS[-1]}"; done
}
vf() { PATH="$VENV/bin:$PATH" PYTHONPATH="$HERE" FLEET_KEY=none "$VENV/bin/vf-eval" fleet_calc -m policy \
  --client.api-key-var FLEET_KEY --env.agent.harness.id null --env.agent.runtime.type subprocess --no-rich --no-push \
  -o "$WORK/outputs" "$@"; }

echo "== 1. inference: 2 tasks x 2 rollouts"
serve "$WORK/plain.json"
vf --client.base-url "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["base_url"])' "$WORK/plain.json")" \
  -n 2 -r 2 > "$WORK/eval-plain.log" 2>&1
grep "rollout done" "$WORK/eval-plain.log"
tail -n 1 "$WORK/plain.json.log"   # the endpoint's call counts

echo "== 2. training: one session"
serve "$WORK/train.json" --session rollout.openai.session_header=X-Fleetrl-Session
SERVER=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["root"])' "$WORK/train.json")
S=$(curl -sf -X POST "$SERVER/fleetrl/sessions" -H 'content-type: application/json' -d '{"wait_s": 10}')
SID=$(echo "$S" | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_id"])')
vf --client.base-url "$(echo "$S" | python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])')" \
  -n 1 -r 1 > "$WORK/eval-train.log" 2>&1
grep "rollout done" "$WORK/eval-train.log"
curl -sf -X POST "$SERVER/fleetrl/sessions/$SID/close" -H 'content-type: application/json' -d '{"reward": 0.0}'; echo
sleep 2; tail -n 1 "$WORK/train.json.log"   # the episode: turns, tokens, loss-mask ones, reward
echo "logs and verifiers' traces in $WORK"
