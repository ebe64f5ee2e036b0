"""The `hf` engine under requests that arrive continuously: continuous batching against waves.

    python benchmarks/hf_engine.py [--preset small] [--groups 120] [--group-rate 25] [--n 8]
                                   [--modes continuous,waves | --waves] [--threads N] [--out FILE]

The workload mimics a rollout server: groups of ``--n`` requests (one prompt, per-request seeds)
arrive as a Poisson process of ``--group-rate`` groups/s; prompts are 10 to ``--max-prompt`` tokens
of random text; a ``--long-fraction`` of the groups asks for ``--long-tokens`` new tokens, the rest
for ``--short-tokens``. The model is the demo's size (``init_model`` preset ``small``, built locally,
random weights), so responses run to their max_new_tokens (eos is rare) and, since every request
has its own seed, both modes generate the same tokens: the figures compare the same work.

Each mode (`rollout.hf.continuous` true / false) runs the same schedule on a fresh engine after a
warm-up; reported: generated tokens/s over the run (first arrival to last completion), request
latency (arrival to completion: mean, p50, p90) and the CPU share other processes took
(``others_cpu_share``; a figure taken above 0.10 does not count). Prints a table and writes
benchmarks/results/hf_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from fleetrl.common.config.schema import HfConfig, ModelConfig, RolloutConfig
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.engines import Request, SamplingParams, create_engine

RESULTS = Path(__file__).parent / "results" / "hf_engine.json"


class Load:
    """CPU seconds the machine spent outside this process while a run lasted, as a share of all cores."""

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


def schedule(args: argparse.Namespace, vocab: list[int]) -> list[tuple[float, list[Request]]]:
    """(arrival time in s, the group's requests) for every group, from ``--seed``."""
    rng = random.Random(args.seed)
    at, groups = 0.0, []
    for g in range(args.groups):
        at += rng.expovariate(args.group_rate)
        prompt = [rng.choice(vocab) for _ in range(rng.randint(10, args.max_prompt))]
        tokens = args.long_tokens if rng.random() < args.long_fraction else args.short_tokens
        groups.append(
            (at, [Request(prompt, SamplingParams(max_new_tokens=tokens, seed=g * args.n + j)) for j in range(args.n)])
        )
    return groups


async def replay(engine, groups: list[tuple[float, list[Request]]]) -> tuple[float, list[float], int]:
    """Submit each group at its arrival time; returns (seconds, latency of each request, tokens)."""
    start = time.monotonic()
    latencies: list[float] = []

    async def one(at: float, request: Request) -> int:
        out = await engine.generate(request)
        latencies.append(time.monotonic() - start - at)
        return len(out.token_ids)

    tasks = []
    for at, requests in groups:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        tasks += [asyncio.ensure_future(one(at, r)) for r in requests]
    tokens = sum(await asyncio.gather(*tasks))
    return time.monotonic() - start - groups[0][0], latencies, tokens


def run_mode(model_dir: str, continuous: bool, groups, threads: int) -> dict:
    cfg = RolloutConfig(hf=HfConfig(continuous=continuous))
    engine = create_engine("hf", ModelConfig(path=model_dir), cfg, "cpu", 0, num_threads=threads)
    try:
        engine.generate_batch([groups[0][1][0].prompt_ids], SamplingParams(max_new_tokens=8, seed=0), n=8)  # warm-up
        load = Load()
        seconds, latencies, tokens = engine.loop.call(replay(engine, groups))
        share = load.share()
    finally:
        engine.close()
    latencies.sort()
    return {
        "mode": "continuous" if continuous else "waves",
        "requests": len(latencies),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "latency_mean_s": round(statistics.fmean(latencies), 4),
        "latency_p50_s": round(latencies[len(latencies) // 2], 4),
        "latency_p90_s": round(latencies[int(len(latencies) * 0.9)], 4),
        "others_cpu_share": share,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="init_model preset (the demo's model is `small`)")
    parser.add_argument("--groups", type=int, default=120)
    parser.add_argument("--group-rate", type=float, default=25.0, help="groups arriving per second (Poisson)")
    parser.add_argument("--n", type=int, default=8, help="requests per group (rollout.group_size)")
    parser.add_argument("--max-prompt", type=int, default=120, help="longest prompt, in tokens")
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=96)
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--modes", default="continuous,waves", help="comma-separated: continuous, waves")
    parser.add_argument("--waves", action="store_true", help="run only the older waves (same as --modes waves)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    modes = ["waves"] if args.waves else [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"continuous", "waves"}:
        parser.error(f"--modes {args.modes!r}: give continuous, waves or both")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(Path(tmp) / args.preset, preset=args.preset, seed=0))
        vocab = list(range(10, 100))  # printable bytes of the byte-level tokenizer
        groups = schedule(args, vocab)
        runs = [run_mode(model_dir, mode == "continuous", groups, args.threads) for mode in modes]

    print(f"{'mode':<12}{'tokens/s':>10}{'mean lat s':>12}{'p50 s':>8}{'p90 s':>8}{'others':>8}")
    for r in runs:
        print(
            f"{r['mode']:<12}{r['tokens_per_s']:>10}{r['latency_mean_s']:>12}{r['latency_p50_s']:>8}"
            f"{r['latency_p90_s']:>8}{r['others_cpu_share']:>8.0%}"
        )
    result = {
        "args": vars(args),
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "time": time.time(),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
