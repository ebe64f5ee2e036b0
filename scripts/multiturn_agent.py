"""An agent written with the official `openai` client, trained through a rollout server's endpoint.

    fleetrl run --config configs/multiturn.yaml rollout.env.type=openai rollout.openai.enabled=true &
    python scripts/multiturn_agent.py --server http://127.0.0.1:8000 --workers 128

`solve` is an ordinary tool-using agent loop: it would run unchanged against any OpenAI-compatible
server, its calls made with the official client (`--client openai`, the default) or as plain JSON posts on
the same HTTP client (`--client raw`: what an agent that skips the openai package costs the box). The only fleetrl-specific lines are in `run_session`: take a task (POST /fleetrl/sessions),
point the client's base_url at the session, and close the session with a reward (the close also opens the
next session when a task is waiting: ``"next"``, one request a session fewer). The agent scores
itself here (exact match); `--server-reward` leaves the scoring to the job's rollout.rewards instead.

Concurrency the way one drives many sessions from Python: `openai.AsyncOpenAI` in one asyncio loop,
`--workers` sessions as tasks, one pooled HTTP client under every task's client: `openai.DefaultAioHttpClient`
(openai's aiohttp transport) when aiohttp is installed, else `httpx.AsyncClient` (`--http`). (Threads
around the sync client cost ~3x the CPU a call: GIL hand-offs; see docs/notes/issue-28.md.)
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import sys
import time
import traceback
from collections.abc import Awaitable, Callable

import openai

try:  # the http library the installed openai pools with: httpx2 from openai 3 (httpcore2's pool costs O(n) a
    import httpx2 as httpx  # request; httpcore's scans every pooled connection for each idle one: O(n^2), ~20 ms
except ImportError:  # of CPU a call with 256 connections), httpx before
    import httpx

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


Chat = Callable[[list[dict]], Awaitable[dict | None]]  # one call: the reply's message (None: out of budget)
OUT_OF_BUDGET = ("context_length_exceeded", "session_budget_exceeded")


async def solve(chat: Chat, question: str, max_turns: int = 3) -> tuple[str, dict[str, int]]:
    """The agent: ask, run the tool calls the model makes, hand the results back, until it answers."""
    messages = [{"role": "user", "content": question}]
    stats = {"turns": 0, "tool_calls": 0, "tool_errors": 0}
    for _ in range(max_turns):
        msg = await chat(messages)
        if msg is None:
            return "", stats  # out of budget: no answer (the session is closed and scored as it stands)
        stats["turns"] += 1
        messages.append(msg)
        if not msg.get("tool_calls"):
            return msg.get("content") or "", stats
        for call in msg["tool_calls"]:
            stats["tool_calls"] += 1
            try:
                result = calc(**json.loads(call["function"]["arguments"]))
            except Exception as e:  # noqa: BLE001 - the tool's error is its answer
                stats["tool_errors"] += 1
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return "", stats


def openai_chat(client: openai.AsyncOpenAI) -> Chat:
    """A call with the official client (what an agent built on `openai` does)."""

    async def chat(messages: list[dict]) -> dict | None:
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC_TOOL], max_tokens=16
            )
        except openai.BadRequestError as e:
            if e.code in OUT_OF_BUDGET:
                return None
            raise
        return reply.choices[0].message.model_dump(exclude_none=True)

    return chat


class CallFailed(Exception):
    """A raw call the endpoint answered with an error."""


def raw_chat(http: httpx.AsyncClient, base_url: str, auth: dict[str, str]) -> Chat:
    """The same call as JSON over the pooled HTTP client, without the openai package (``--client raw``): what an
    agent that posts its own requests costs."""

    async def chat(messages: list[dict]) -> dict | None:
        body = {"model": "policy", "messages": messages, "tools": [CALC_TOOL], "max_tokens": 16}
        r = await http.post(f"{base_url}/chat/completions", json=body, headers=auth, timeout=60)
        if r.status_code != 200:
            error = r.json().get("error") or {}
            if r.status_code == 400 and error.get("code") in OUT_OF_BUDGET:
                return None
            raise CallFailed(f"{r.status_code}: {error.get('message', r.text[:200])}")
        return r.json()["choices"][0]["message"]

    return chat


async def run_session(
    http: httpx.AsyncClient,
    client: openai.AsyncOpenAI | None,
    args: argparse.Namespace,
    totals: dict[str, float],
    session: dict | None = None,
) -> dict | None:
    """One fleetrl session: take a task (or the ``session`` the last close opened), solve it with a client pointed
    at the session (``client``; None: raw JSON calls), close it with a reward; returns the next session when the
    close opened one."""
    auth = {"Authorization": f"Bearer {args.api_key}"}
    if session is None:
        r = await http.post(f"{args.server}/fleetrl/sessions", json={"wait_s": 10}, headers=auth, timeout=30)
        if r.status_code == 503:
            return None  # no task right now (paused, between leases): ask again
        r.raise_for_status()
        session = r.json()
    url = f"{args.server}/fleetrl/sessions/{session['session_id']}"
    if client is not None:
        client.base_url = session["base_url"]  # <- the only change to an agent: its client's base_url
    chat = openai_chat(client) if client is not None else raw_chat(http, session["base_url"], auth)
    try:
        answer, stats = await solve(chat, session["task"]["prompt"])
    except (openai.APIError, CallFailed) as e:
        await http.post(f"{url}/abandon", headers=auth)
        print(f"session {session['session_id']} abandoned: {e}", file=sys.stderr)
        return None
    reward = float(answer.strip() == str(session["task"]["answer"]))
    # the close also opens the next session when a task is waiting ("next", wait_s 0: the answer to the close is
    # not held back): one request a session fewer than a separate open
    body: dict = {"next": {"wait_s": 0}} if time.monotonic() < args.deadline else {}
    if not args.server_reward:
        body["reward"] = reward
    r = await http.post(f"{url}/close", json=body, headers=auth, timeout=30)
    totals["sessions"] += 1
    totals["correct"] += reward
    for k, v in stats.items():
        totals[k] = totals.get(k, 0) + v
    return r.json().get("next") if r.status_code == 200 else None


async def worker(http: httpx.AsyncClient, args: argparse.Namespace, totals: dict[str, float], deadline: float) -> None:
    """Sessions one after another until the deadline; gives up after 30 failures in a row (the server is gone)."""
    # One openai client a worker, on the shared pool, re-pointed at each session: a client made per session (or by
    # with_options) looks the platform up again in a worker thread on its first call (~5% of the agent's CPU).
    client = None
    if args.client == "openai":
        client = openai.AsyncOpenAI(base_url=args.server, api_key=args.api_key, max_retries=2, http_client=http)
    failures, session = 0, None
    while session is not None or time.monotonic() < deadline:  # a session the last close opened is run too
        try:
            session = await run_session(http, client, args, totals, session)
            failures = 0
        except (httpx.HTTPError, openai.APIConnectionError):
            session = None
            failures += 1  # the server is starting, or gone at the end of the run
            if failures > 30:
                return
            await asyncio.sleep(1.0)
        except Exception:  # noqa: BLE001 - a bug ends this task (printed), as it ended a thread before: not the agent
            traceback.print_exc()
            return


async def report(totals: dict[str, float], out: str | None, done: asyncio.Event) -> None:
    """Every 30 s (with --out; else every second, printing nothing): the totals and the window's success rate."""
    t0, last = time.monotonic(), dict(totals)
    while not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), 30 if out else 1)
        except TimeoutError:
            pass
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
        if out and n:
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)


def http_client(kind: str, limits: httpx.Limits) -> httpx.AsyncClient:
    """The pooled HTTP client under every call. "aiohttp": `openai.DefaultAioHttpClient` (the openai package's
    aiohttp transport, `pip install openai[aiohttp]`): its C-parsed HTTP/1.1 cut the agent's CPU a sample by ~40%
    against the default pool (pure-Python h11 and httpcore2, whose pool scans every connection per request);
    "httpx": the default. "auto": aiohttp when this openai has it installed, else the default."""
    if kind != "httpx":
        try:  # an openai without the aiohttp extra raises RuntimeError here (older ones lack the class)
            return openai.DefaultAioHttpClient(timeout=60, limits=limits)
        except (AttributeError, RuntimeError) as e:
            if kind == "aiohttp":
                raise SystemExit(f"--http aiohttp: {e} (pip install 'openai[aiohttp]')") from None
    return httpx.AsyncClient(timeout=60, limits=limits)


async def run(args: argparse.Namespace) -> dict[str, float]:
    totals: dict[str, float] = {"sessions": 0, "correct": 0}
    deadline = args.deadline = time.monotonic() + 60 * args.minutes
    # One pooled HTTP client under every call: a new httpx/openai client per session builds an SSL context each
    # time (~15-35 ms of CPU).
    limits = httpx.Limits(max_connections=args.workers + 8, max_keepalive_connections=args.workers + 8)
    async with http_client(args.http, limits) as http:
        done = asyncio.Event()
        reporter = asyncio.create_task(report(totals, args.out, done))
        await asyncio.gather(*(worker(http, args, totals, deadline) for _ in range(args.workers)))
        done.set()
        await reporter
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="http://127.0.0.1:8000", help="the rollout server's endpoint root")
    p.add_argument("--api-key", default="none", help="rollout.openai.api_key, if set")
    p.add_argument("--workers", type=int, default=128, help="sessions run at once (>= rollout.group_size)")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this long")
    p.add_argument("--server-reward", action="store_true", help="close without a reward: rollout.rewards score it")
    p.add_argument(
        "--http",
        choices=["auto", "aiohttp", "httpx"],
        default="auto",
        help="the HTTP transport (auto: aiohttp if installed)",
    )
    p.add_argument(
        "--client",
        choices=["openai", "raw"],
        default="openai",
        help="openai: the official client's chat.completions.create; raw: the same calls as plain JSON posts",
    )
    p.add_argument("--out", help="write the totals as JSON lines here, every 30 s")
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
