"""What the OpenAI-compatible endpoint adds to one completion, against calling the engine directly.

    python benchmarks/endpoint_overhead.py [--preset small] [--tokens 32] [--trials 40]

Builds the preset locally, starts the endpoint on loopback (rollout/endpoint/server.py) and times, in
alternating order, one greedy chat completion of ``--tokens`` tokens (no eos: ``stop_token_ids`` empty
and ``--tokens`` forced with ``ignore_eos``-like length: the model is untrained, so it rarely stops):

- direct: the chat template + tokenize + ``engine.submit(Request).result()``, as a caller inside the
  rollout server would;
- endpoint: the official ``openai`` client's ``chat.completions.create`` over HTTP (JSON, template,
  engine, reply), plain inference; and the same call inside a training session (token-in/token-out
  bookkeeping included).

Reports medians and the overhead in percent, with the CPU share other processes used during the run
(``others_cpu_share``; figures from a busy machine are flagged there). Writes
benchmarks/results/endpoint_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

RESULTS = Path(__file__).parent / "results" / "endpoint_overhead.json"


class Load:
    """CPU seconds the machine spent outside this process while a run lasted."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), self.busy(), self.own()

    @staticmethod
    def busy() -> float:
        from fleetrl.common.telemetry.cpu import machine_busy_s

        return machine_busy_s()

    @staticmethod
    def own() -> float:
        c = psutil.Process().cpu_times()
        return c.user + c.system

    def share(self) -> float:
        wall = time.monotonic() - self.t0
        others = (self.busy() - self.busy0) - (self.own() - self.own0)
        return round(max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9), 3)


def main() -> int:
    import openai

    from fleetrl.common.config import load_config
    from fleetrl.learner.init_model import init_model
    from fleetrl.rollout.endpoint.server import Endpoint
    from fleetrl.rollout.engines import Request, SamplingParams, create_engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = init_model(Path(tempfile.mkdtemp()) / a.preset, preset=a.preset)
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            "rollout.openai.enabled=true",
            "rollout.openai.port=0",
            "rollout.env.type=openai",
            f"rollout.max_new_tokens={a.tokens}",
            "rollout.temperature=0",
            "rollout.device=cpu",
        ],
    )
    engine = create_engine("hf", cfg.model, cfg.rollout, "cpu", 0, num_threads=a.threads)
    from fleetrl.rollout.envs import create_env

    env = create_env(cfg, engine.tokenizer)
    endpoint = Endpoint(cfg, engine, env)
    endpoint.start()
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "12*34="}]
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_new_tokens=a.tokens)

    def direct() -> tuple[int, float]:
        t0 = time.perf_counter()
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        n = len(engine.submit(Request(ids, params)).result().token_ids)
        return n, time.perf_counter() - t0

    def via_endpoint() -> tuple[int, float]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=a.tokens, temperature=0)
        return r.usage.completion_tokens, time.perf_counter() - t0

    def via_session() -> tuple[int, float]:
        """The first call of a fresh training session (its slot is offered and opened untimed, in-process)."""
        from fleetrl.common import messages as m
        from fleetrl.rollout.envs.base import Task

        task = Task(m.Prompt("bench:0", messages[0]["content"]))
        fut = engine.loop.submit(env.sessions.offer(task, params, "bench/0/0", engine))
        s = engine.loop.call(env.sessions.start(5.0))
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model="m", messages=messages, max_tokens=a.tokens, extra_headers={"X-Fleetrl-Session": s.id}
        )
        took = time.perf_counter() - t0
        engine.loop.loop.call_soon_threadsafe(env.sessions.end, s.id, 1.0)
        fut.result(5)
        return r.usage.completion_tokens, took

    runs = {"direct": direct, "endpoint": via_endpoint, "session": via_session}
    for fn in runs.values():  # warm up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    tokens: dict[str, int] = {}
    load = Load()
    for _ in range(a.trials):
        for name, fn in runs.items():
            tokens[name], took = fn()
            times[name].append(took)
    share = load.share()
    endpoint.close()
    engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "preset": a.preset,
        "tokens": tokens,
        "trials": a.trials,
        "threads": a.threads,
        "median_ms": {k: round(1000 * v, 2) for k, v in med.items()},
        "overhead_pct": {k: round(100 * (med[k] / med["direct"] - 1), 2) for k in ("endpoint", "session")},
        "overhead_ms": {k: round(1000 * (med[k] - med["direct"]), 2) for k in ("endpoint", "session")},
        "others_cpu_share": share,
        "eos_id": eos,
        "time": time.time(),
    }
    print(json.dumps(out, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
