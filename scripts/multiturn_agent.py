"""An agent written with the official `openai` client, trained through a rollout server's endpoint.

    fleetrl run --config configs/multiturn.yaml rollout.env.type=openai rollout.openai.enabled=true &
    python scripts/multiturn_agent.py --server http://127.0.0.1:8000 --workers 16

`solve` is an ordinary tool-using agent loop: it would run unchanged against any OpenAI-compatible
server. The only fleetrl-specific lines are in `run_session`: take a task (POST /fleetrl/sessions),
point the client's base_url at the session, and close the session with a reward. The agent scores
itself here (exact match); `--server-reward` leaves the scoring to the job's rollout.rewards instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import threading
import time

import httpx
import openai

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in OPS:
            return OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError("unsupported expression")

    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value) if float(value).is_integer() else value)


def solve(client: openai.OpenAI, question: str, max_turns: int = 3) -> tuple[str, dict[str, int]]:
    """The agent: ask, run the tool calls the model makes, hand the results back, until it answers."""
    messages = [{"role": "user", "content": question}]
    stats = {"turns": 0, "tool_calls": 0, "tool_errors": 0}
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL], max_tokens=16)
        except openai.BadRequestError as e:
            if e.code in ("context_length_exceeded", "session_budget_exceeded"):
                return "", stats  # out of budget: no answer (the session is closed and scored as it stands)
            raise
        msg = reply.choices[0].message
        stats["turns"] += 1
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or "", stats
        for call in msg.tool_calls:
            stats["tool_calls"] += 1
            try:
                result = calc(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001 - the tool's error is its answer
                stats["tool_errors"] += 1
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "", stats


def run_session(
    http: httpx.Client, server: str, api_key: str, server_reward: bool, totals: dict[str, float], lock: threading.Lock
) -> bool:
    r = http.post(
        f"{server}/fleetrl/sessions", json={"wait_s": 10}, headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    )
    if r.status_code == 503:
        return True  # no task right now (paused, between leases): ask again
    r.raise_for_status()
    session = r.json()
    client = openai.OpenAI(
        base_url=session["base_url"],
        api_key=api_key,
        max_retries=2,  # <- the only change
        http_client=http,
    )  # one HTTP client for every session: see main()
    try:
        answer, stats = solve(client, session["task"]["prompt"])
    except openai.APIError as e:
        http.post(
            f"{server}/fleetrl/sessions/{session['session_id']}/abandon", headers={"Authorization": f"Bearer {api_key}"}
        )
        print(f"session {session['session_id']} abandoned: {e}", file=sys.stderr)
        return True
    reward = float(answer.strip() == str(session["task"]["answer"]))
    http.post(
        f"{server}/fleetrl/sessions/{session['session_id']}/close",
        json={} if server_reward else {"reward": reward},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    with lock:
        totals["sessions"] += 1
        totals["correct"] += reward
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + v
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the rollout server's endpoint root")
    p.add_argument("--api-key", default="none", help="rollout.openai.api_key, if set")
    p.add_argument("--workers", type=int, default=16, help="sessions run at once (>= rollout.group_size)")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this long")
    p.add_argument("--server-reward", action="store_true", help="close without a reward: rollout.rewards score it")
    p.add_argument("--out", help="write the totals as JSON lines here, every 30 s")
    args = p.parse_args()
    totals: dict[str, float] = {"sessions": 0, "correct": 0}
    lock, stop = threading.Lock(), threading.Event()
    deadline = time.monotonic() + 60 * args.minutes
    # One HTTP client (thread-safe, pooled) for every call: a new httpx/openai client per session builds an SSL
    # context each time (~15-35 ms of CPU), which made the agent, not the server, the demo's bottleneck.
    http = httpx.Client(
        timeout=60, limits=httpx.Limits(max_connections=2 * args.workers, max_keepalive_connections=2 * args.workers)
    )

    def worker() -> None:
        failures = 0
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                run_session(http, args.server, args.api_key, args.server_reward, totals, lock)
                failures = 0
            except (httpx.HTTPError, openai.APIConnectionError):
                failures += 1  # the server is starting, or gone at the end of the run
                if failures > 30:
                    return
                time.sleep(1.0)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    for t in threads:
        t.start()
    t0, last = time.monotonic(), dict(totals)
    while any(t.is_alive() for t in threads):
        time.sleep(30 if args.out else 1)
        with lock:
            now = dict(totals)
        n = now["sessions"] - last["sessions"]
        line = {
            "time": time.time(),
            "elapsed_s": round(time.monotonic() - t0),
            **now,
            "success_window": (now["correct"] - last["correct"]) / n if n else None,
            "turns_per_session": (now.get("turns", 0) - last.get("turns", 0)) / n if n else None,
        }
        last = now
        if args.out and n:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
