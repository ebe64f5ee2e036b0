"""Sessions per second through the OpenAI endpoint against episodes per second of the in-process tool
environment, on the multi-turn demo's settings, and where an endpoint call's time goes (issue 28).

    python benchmarks/endpoint_sessions.py [--model DIR] [--seconds 45] [--rounds 2] [--workers 128]

One rollout server (configs/multiturn.yaml: the `calc` tool, group 8 x 16 prompts, temperature 0.6, up to
3 turns) on the broker twin, its groups drained as a learner would (no training: weights stay put, so
both modes sample the same policy), in alternating order (tool, endpoint, tool, endpoint, ...):

- **tool**: ``rollout.env.type: tool``, episodes run inside the server;
- **endpoint**: ``rollout.env.type: openai``, the same episodes driven by ``scripts/multiturn_agent.py``
  (the official ``openai`` client's ``AsyncOpenAI``, ``--workers`` sessions as asyncio tasks on one pooled
  http client) in its own process; ``--agent`` drives another agent script with the same arguments;
- **endpoint-raw** (``--modes tool endpoint endpoint-raw``): the same agent with ``--client raw``, its calls
  as plain JSON posts on the same HTTP client, without the openai package (what the endpoint gives an agent
  whose client costs little).

Each mode warms up ``--warmup`` seconds, then counts the samples of the groups drained during
``--seconds``. Reported per mode: samples/s (median of the rounds), the ratio endpoint/tool (target >=
0.5), and for the endpoint where a call's time went: the handler's wall time per call, of it the wait for
the engine and the session context (template + tokens), and the agent process's CPU seconds per session.
CPU seconds per sample (server + agent) are reported too: on a busy box they are the steadier measure, and
on a CPU-bound quiet box the throughput ratio tends to ``cpu_ratio_tool_to_endpoint``.
The CPU other processes used while it ran is recorded (``others_cpu_share``); the box is shared, so a
figure with a share above 0.1 is not a quiet figure. Writes benchmarks/results/endpoint_sessions.json.
Both modes get the whole box: the tool env's engine ``--threads`` (all cores); the endpoint's engine
``--endpoint-threads`` (all cores less one) and the agent process the core left: an engine with 2 torch
threads beside the agent's process on 2 cores cost 0.060-0.087 CPU seconds a sample against 0.016-0.036 with 1
(its OpenMP threads spin and wait for a core). The agent runs ``--workers`` 128 sessions (the tool env's
episodes per lease); measured on 2 cores (busy box, docs/notes/issue-28.md), the async agent with 128 costs
about what the old thread-per-session agent did with 32 (server + agent ~0.016 s a sample: the server's share
smaller with more calls in flight, the agent's larger), where 128 threads cost 0.036.
``--model`` defaults to a fresh ``small`` preset (untrained: mostly one-turn episodes); the demo's warm
start (models/multiturn-warm) gives the demo's turn mix.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "endpoint_sessions.json"


def machine_busy() -> float:
    t = psutil.cpu_times()._asdict()
    return sum(t.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def tree_cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def thread_cpu() -> dict[int, tuple[str, float]]:
    """This process's threads: id -> (kind, CPU seconds). Kinds: ``decode`` (the hf engine's decode thread: the
    model), ``loop`` (the engines' event loop: HTTP, JSON, sessions, chat templates; the tool env's episodes and
    tools), ``native`` (threads Python did not start: torch's and the tokenizer's pools), ``other`` (the rollout
    server, draining)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    kinds = {"hf-engine-decode": "decode", "hf-engines-loop": "loop"}
    return {
        t.id: ("native" if names.get(t.id) is None else kinds.get(names[t.id], "other"), t.user_time + t.system_time)
        for t in psutil.Process().threads()
    }


def cpu_by_thread(before: dict[int, tuple[str, float]], own_s: float, samples: int) -> dict[str, float]:
    """CPU seconds per sample by kind of thread since ``before``; ``decode`` is the rest of the process's CPU (the
    decode thread ends when idle and a new one starts: a thread that ended is counted there)."""
    out = dict.fromkeys(("loop", "native", "other"), 0.0)
    for tid, (kind, cpu) in thread_cpu().items():
        if kind != "decode":
            out[kind] += cpu - before.get(tid, (kind, 0.0))[1]
    out["decode"] = own_s - sum(out.values())
    return {k: round(v / max(samples, 1), 5) for k, v in out.items()}


def calc_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}*{b}=", "answer": str(a * b)})
    return rows


def run_mode(mode: str, model: str, a: argparse.Namespace) -> dict[str, float]:
    from fleetrl.broker.client.inproc import InprocBroker
    from fleetrl.broker.server.prompts import PromptSource, rows_to_prompts
    from fleetrl.broker.server.state import BrokerState
    from fleetrl.common import messages as m
    from fleetrl.common.config import load_config
    from fleetrl.rollout.endpoint.server import Endpoint
    from fleetrl.rollout.engines import create_engine
    from fleetrl.rollout.rewards import RewardScorer
    from fleetrl.rollout.server import RolloutServer

    overrides = [
        f"model.path={model}",
        "rollout.device=cpu",
        f"rollout.env.type={'tool' if mode == 'tool' else 'openai'}",
        "learner.groups_per_step=16",
        *(
            [
                "rollout.openai.enabled=true",
                "rollout.openai.port=0",
                f"rollout.openai.max_sessions_per_client={a.workers}",
            ]
            if mode != "tool"
            else []
        ),
        *a.set,
    ]
    cfg = load_config(str(ROOT / "configs" / "multiturn.yaml"), overrides)
    prompts = PromptSource(
        rows_to_prompts(calc_rows(20000), "prompt", "answer", "bench"), shuffle=False, seed=0, epochs=1
    )
    state = BrokerState(cfg, prompts, vocab_size=0)
    broker = InprocBroker(state)
    threads = a.threads if mode == "tool" else a.endpoint_threads
    engine = create_engine("hf", cfg.model, cfg.rollout, "cpu", 0, num_threads=threads)
    scorer = RewardScorer.from_config(cfg.rollout)
    server = RolloutServer(cfg, broker.client("rollout-0-bench", "rollout"), engine, scorer)
    if mode != "tool":
        server.endpoint = Endpoint(cfg, engine, server.env)
    learner = broker.client("learner-0", "learner")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    agent = None
    try:
        procs = [psutil.Process()]
        if mode != "tool":
            deadline = time.monotonic() + 60
            while not server.endpoint.port and time.monotonic() < deadline:
                time.sleep(0.1)
            agent = subprocess.Popen(
                [
                    sys.executable,
                    a.agent,
                    "--server",
                    server.endpoint.root,
                    "--workers",
                    str(a.workers),
                    "--minutes",
                    str((a.warmup + a.seconds + 30) / 60),
                    *(["--client", "raw"] if mode == "endpoint-raw" else []),
                ],
                stdout=subprocess.DEVNULL,
            )
            procs.append(psutil.Process(agent.pid))

        def drain() -> int:
            n = 0
            while isinstance(lease := learner.lease_batch(1000), m.BatchLease):
                learner.ack_batch(lease.lease_id, [g.group_id for g in lease.groups], 1)
                n += sum(g.num_responses for g in lease.groups)
            return n

        end_warm = time.monotonic() + a.warmup
        while time.monotonic() < end_warm:
            drain()
            time.sleep(0.2)
        ep0 = server.endpoint.metrics() if mode != "tool" else {}
        busy0, own0, agent0, threads0 = machine_busy(), tree_cpu(procs[:1]), tree_cpu(procs[1:]), thread_cpu()
        t0, samples = time.monotonic(), 0
        while time.monotonic() - t0 < a.seconds:
            samples += drain()
            time.sleep(0.2)
        wall = time.monotonic() - t0
        samples += drain()
        own, agent_cpu = tree_cpu(procs[:1]) - own0, tree_cpu(procs[1:]) - agent0
        by_thread = cpu_by_thread(threads0, own, samples)
        others = max(0.0, (machine_busy() - busy0) - own - agent_cpu) / (wall * (os.cpu_count() or 1))
        out = {
            "samples_per_s": samples / wall,
            "samples": samples,
            "wall_s": round(wall, 1),
            "others_cpu_share": round(others, 3),
            "server_cpu_s": round(own, 1),
            "cpu_s_per_sample": round((own + agent_cpu) / max(samples, 1), 4),
            "server_cpu_s_per_sample_by_thread": by_thread,
        }
        if mode != "tool":
            ep1 = server.endpoint.metrics()
            d = {k: ep1.get(k, 0.0) - ep0.get(k, 0.0) for k in ep1}
            calls = d.get("openai/calls_session_total", 0.0) or 1.0
            out.update(
                {
                    "agent_cpu_s": round(agent_cpu, 1),
                    "agent_cpu_s_per_sample": round(agent_cpu / max(samples, 1), 4),
                    "calls": calls,
                    "call_ms": 1000 * d.get("openai/time_call_s_total", 0.0) / calls,
                    "engine_ms": 1000 * d.get("openai/time_engine_s_total", 0.0) / calls,
                    "context_ms": 1000 * d.get("openai/time_context_s_total", 0.0) / calls,
                }
            )
        return out
    finally:
        if agent is not None:
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        server.request_stop("benchmark over")
        thread.join(30)
        scorer.close()
        engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model dir (default: a fresh small preset)")
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=128, help="the agent's sessions at once")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads, tool mode")
    p.add_argument(
        "--endpoint-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="engine threads, endpoint mode (default: the cores less one, the agent's)",
    )
    p.add_argument("--agent", default=str(ROOT / "scripts" / "multiturn_agent.py"), help="the agent script to drive")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["tool", "endpoint"],
        choices=["tool", "endpoint", "endpoint-raw"],
        help="endpoint-raw: the agent with --client raw (its calls as plain JSON posts, no openai package)",
    )
    p.add_argument("--set", nargs="*", default=[], help="config overrides (key=value) for both modes")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    model = a.model
    if model is None:
        from fleetrl.learner.init_model import init_model

        model = str(init_model(Path(tempfile.mkdtemp()) / "small", preset="small", seed=0))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in a.modes}
    for _ in range(a.rounds):
        for mode in runs:
            runs[mode].append(run_mode(mode, model, a))
            print(mode, json.dumps(runs[mode][-1]), flush=True)
    cpu = {mode: statistics.median(r["cpu_s_per_sample"] for r in rs) for mode, rs in runs.items()}
    med = {mode: statistics.median(r["samples_per_s"] for r in rs) for mode, rs in runs.items()}
    med.setdefault("tool", 0.0)
    med.setdefault("endpoint", 0.0)
    out = {
        "command": " ".join(sys.argv),
        "model": model,
        "agent": a.agent,
        "rounds": runs,
        "samples_per_s": {k: round(v, 2) for k, v in med.items()},
        "ratio_endpoint_to_tool": round(med["endpoint"] / med["tool"], 3) if med["tool"] else None,
        **(
            {"ratio_endpoint_raw_to_tool": round(med["endpoint-raw"] / med["tool"], 3)}
            if med.get("endpoint-raw") and med["tool"]
            else {}
        ),
        "target_ratio": 0.5,
        "cpu_s_per_sample": cpu,
        "cpu_ratio_tool_to_endpoint": round(cpu["tool"] / cpu["endpoint"], 3)
        if {"tool", "endpoint"} <= set(cpu)
        else None,
        "others_cpu_share_max": max(r["others_cpu_share"] for rs in runs.values() for r in rs),
        "quiet": all(r["others_cpu_share"] <= 0.1 for rs in runs.values() for r in rs),
        "time": time.time(),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
