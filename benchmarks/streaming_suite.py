"""`engine_throughput.py --suite streaming`: streaming against blocking batches on a long-tail workload,
and the pause of in-flight weight updates (see engine_throughput.py's docstring)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, ModelConfig, RolloutConfig, SyncConfig, VllmConfig
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.engines import Request, SamplingParams, create_engine

RESULTS = Path(__file__).parent / "results" / "engine_streaming.json"


class Load:
    """CPU seconds the machine spent outside this process tree while a run lasted."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), self.busy(), self.own()

    @staticmethod
    def busy() -> float:
        t = psutil.cpu_times()._asdict()
        return sum(t.get(k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    @staticmethod
    def own() -> float:
        procs = [psutil.Process()] + psutil.Process().children(recursive=True)
        total = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
        return total

    def result(self) -> dict:
        wall = time.monotonic() - self.t0
        others = max(0.0, (self.busy() - self.busy0) - (self.own() - self.own0))
        return {
            "wall_s": round(wall, 3),
            "others_cpu_share": round(others / max(wall * (os.cpu_count() or 1), 1e-9), 3),
        }


def workload(engine, args) -> list[Request]:
    """Every sample its own request: a fifth may run to long_tokens, the rest stop at short_tokens."""
    rng = random.Random(0)
    requests = []
    for i in range(args.total_prompts):
        ids = engine.tokenizer(f"{i * 7 % 100}+{i * 13 % 100}=", add_special_tokens=False)["input_ids"]
        for j in range(args.n):
            longest = args.long_tokens if rng.random() < args.long_frac else args.short_tokens
            requests.append(Request(ids, SamplingParams(max_new_tokens=longest, seed=1000 * i + j)))
    return requests


async def blocking(engine, requests: list[Request], width: int) -> list:
    """Today's loop: one batch of ``width`` requests at a time, each waiting for its longest sample."""
    out = []
    for start in range(0, len(requests), width):
        out += await engine.generate_many([fresh(r) for r in requests[start : start + width]])
    return out


async def streaming(engine, requests: list[Request], width: int) -> list:
    """The streaming loop: ``width`` requests in flight, a new one the moment one finishes."""
    gate = asyncio.Semaphore(width)

    async def one(r: Request):
        async with gate:
            return await engine.generate(fresh(r))

    return list(await asyncio.gather(*(one(r) for r in requests)))


def fresh(r: Request) -> Request:
    return Request(r.prompt_ids, r.params)  # a new request id per run


def compare(engine, args) -> dict:
    requests = workload(engine, args)
    width = args.batch_prompts * args.n
    engine.loop.call(streaming(engine, requests[:width], width))  # warm-up
    out = {}
    for name, run in (
        ("blocking", blocking),
        ("streaming", streaming),
        ("blocking_2", blocking),
        ("streaming_2", streaming),
    ):
        load = Load()
        samples = engine.loop.call(run(engine, requests, width))
        figures = load.result()
        lengths = [len(s.token_ids) for s in samples]
        figures.update(
            samples_per_s=round(len(samples) / figures["wall_s"], 2),
            tokens=sum(lengths),
            at_max=round(
                sum(len(s.token_ids) == r.params.max_new_tokens for s, r in zip(samples, requests)) / len(samples), 3
            ),
        )
        out[name] = figures
    best = {k: max(out[k]["samples_per_s"], out[f"{k}_2"]["samples_per_s"]) for k in ("blocking", "streaming")}
    out["speedup"] = round(best["streaming"] / best["blocking"], 2)
    out["lengths"] = {
        "mean": round(statistics.mean(lengths), 1),
        "median": statistics.median(lengths),
        "max": max(lengths),
    }
    return out


def inflight_updates(model_dir: str, tmp: Path, args, cfg_rollout: RolloutConfig) -> dict:
    """Updates broadcast over gloo into the vLLM worker while ``width`` requests stream."""
    from transformers import AutoModelForCausalLM

    from fleetrl.common.weightsync.sender.publisher import WeightPublisher

    engine = create_engine("vllm", ModelConfig(path=model_dir, dtype=args.dtype), cfg_rollout, args.device, 0)
    cfg = JobConfig(sync=SyncConfig(transport=args.transport, timeout_s=60))
    receivers = engine.weight_receiver(cfg, args.device, "bench")
    if args.transport == "nccl":  # the learner's side on another GPU: NCCL refuses two ranks on one
        torch.cuda.set_device(torch.device(args.learner_device))
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.learner_device)
    pub = WeightPublisher(cfg, tmp, 0, [ws.make_spec(n, p.shape, p.dtype) for n, p in learner.named_parameters()])
    stop = threading.Event()
    requests = workload(engine, args)
    width = args.batch_prompts * args.n

    async def keep_streaming():
        while not stop.is_set():
            await streaming(engine, requests[:width], width)

    load = engine.loop.submit(keep_streaming())
    pauses, rpc, publish_s = [], [], []
    try:
        for version in range(1, args.updates + 1):
            with torch.no_grad():
                for p in learner.parameters():
                    p.mul_(1.0 + 1e-3)
            rpc0 = engine.rpc_bytes
            t_pub = time.perf_counter()
            pub.publish(
                version, version, learner.named_parameters(), lambda info: receivers.on_version(version, info), 1
            )
            publish_s.append(time.perf_counter() - t_pub)
            while receivers.pending_version() != version:
                time.sleep(0.02)
            t0 = time.perf_counter()
            assert (
                engine.loop.call(engine.swap_weights(lambda: receivers.apply(engine), cfg_rollout.inflight_update))
                == version
            )
            pauses.append(1000 * (time.perf_counter() - t0))
            rpc.append(engine.rpc_bytes - rpc0)
    finally:
        stop.set()
        load.result(300)
        receivers.close()
        pub.close()
        engine.close()
    model_bytes = sum(p.numel() * p.element_size() for p in learner.parameters())
    return {
        "pause_ms": [round(p, 1) for p in pauses],
        "pause_ms_median": round(statistics.median(pauses), 1),
        "pause_ms_max": round(max(pauses), 1),
        "rpc_bytes_per_update": rpc,
        "model_bytes": model_bytes,
        "publish_s_median": round(statistics.median(publish_s), 3),
        "transport": args.transport,
        "in_flight": width,
    }


def run_streaming_suite(args, machine: dict) -> None:
    presets = args.presets or ["tiny32", "small"]
    if "small" not in presets:
        args.skip_long_tail = True
    results = {
        "machine": machine,
        "workload": {k: v for k, v in vars(args).items() if k != "out"},
        "engine": args.engine,
    }
    cfg_rollout = RolloutConfig(vllm=VllmConfig(enforce_eager=args.device == "cpu", max_model_len=512))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {p: str(init_model(Path(tmp) / p, preset=p, seed=0)) for p in presets}
        if not args.skip_long_tail:
            engine = create_engine(
                args.engine, ModelConfig(path=dirs["small"], dtype=args.dtype), cfg_rollout, args.device, 0
            )
            try:
                results["long_tail_small"] = compare(engine, args)
            finally:
                engine.close()
        if args.engine == "vllm":
            for p in presets:
                results[f"inflight_update_{p}"] = inflight_updates(dirs[p], Path(tmp) / f"pub-{p}", args, cfg_rollout)
    lt = results.get("long_tail_small")
    if lt:
        print(
            f"long tail (small, {args.engine}): blocking {lt['blocking']['samples_per_s']} / {lt['blocking_2']['samples_per_s']}"
            f" samples/s, streaming {lt['streaming']['samples_per_s']} / {lt['streaming_2']['samples_per_s']}"
            f" -> {lt['speedup']}x (others' CPU share {lt['streaming']['others_cpu_share']})"
        )
    for p in presets:
        if f"inflight_update_{p}" in results:
            r = results[f"inflight_update_{p}"]
            print(
                f"in-flight update ({p}): pause median {r['pause_ms_median']} ms, max {r['pause_ms_max']} ms, "
                f"collective_rpc {max(r['rpc_bytes_per_update'])} bytes/update (model {r['model_bytes']} bytes), "
                f"{r['transport']} publish {r['publish_s_median']} s"
            )
    out = Path(args.out) if args.out and not args.out.endswith("engine_throughput.json") else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
