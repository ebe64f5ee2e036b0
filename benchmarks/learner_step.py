"""Learner step time against a bare torch forward/backward/AdamW step of the same model and batch.

For each preset (tiny, small): one batch of 16 groups x 8 responses (prompts of 6 tokens, responses of
4 tokens, like the demo), timed over several steps after a warm-up:

- ``fleetrl``: what the learner does per step from the leased groups: ``actor.plan`` (pack once onto
  the device) and ``actor.step`` on the DeepSpeed engine (ZeRO-0, fp32, CPU): log-probs, GRPO
  advantages, the clipped loss with TIS, backward, clipping, AdamW step, metrics. Run from a
  checkout before the packing change (``learner/batch.py`` with ``batch_from_groups``) it times that
  code's per-step path instead (``batch_from_groups`` + ``Actor.step``), so the two can be compared in
  one sitting: ``--label before`` / ``--label after`` and ``--compare``.
- ``bare``: the same model in plain torch: forward, log-softmax/gather, a policy-gradient loss with the
  same advantages, backward, clip_grad_norm_, AdamW step.

    python benchmarks/learner_step.py [--steps 20] [--threads 1] [--label after]

Figures go to stdout and benchmarks/results/learner_step.json (``--out``): wall time, and the process's
CPU time (``time.process_time``: with ``--threads`` > 1 the OpenMP workers count too), which a busy machine
inflates much less than wall time. Targets: trained
samples/s on the small preset >= 1.15x the code before packing once; the tiny preset's fixed
overhead below +15% of bare torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_groups(vocab: int, n_groups: int = 16, group_size: int = 8, resp_len: int = 4):
    import numpy as np

    from fleetrl.common import messages as m

    rng = np.random.default_rng(0)
    groups = []
    for g in range(n_groups):
        responses = [(rng.integers(7, vocab, resp_len), -rng.random(resp_len)) for _ in range(group_size)]
        groups.append(
            m.build_group(
                f"g{g}", f"0:{g}", 0, rng.integers(7, vocab, 6), responses, [float(i % 2) for i in range(group_size)]
            )
        )
    return groups


def learner_step_fn(model_dir: str, overrides: list[str] = []):  # noqa: B006 - read only
    """(one learner step from leased groups, samples per step) on the code this script runs against."""
    import torch

    from fleetrl.common.config import load_config
    from fleetrl.learner.runtime import build_engine, init_distributed, load_causal_lm, train_dtype

    cfg = load_config(None, [f"model.path={model_dir}", "learner.device=cpu", "learner.lr=1e-5", *overrides])
    dist = init_distributed(cfg)
    dtype = train_dtype(cfg, dist.device)
    engine, _, _ = build_engine(load_causal_lm(model_dir, cfg, dtype), cfg, dtype)
    groups = make_groups(engine.module.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    try:
        from fleetrl.learner.actor import PolicyActor
        from fleetrl.learner.source import Leased

        actor = PolicyActor(engine, None, cfg, dist.device, gen)
        return (lambda: actor.step(actor.plan(Leased(groups=groups)), 0)), 128
    except ImportError:  # the code before packing once: a CPU batch, re-padded into micro-batches in every pass
        from fleetrl.learner.actor import Actor
        from fleetrl.learner.batch import batch_from_groups

        actor = Actor(engine, None, cfg, dist.device, gen)
        return (lambda: actor.step(batch_from_groups(groups), 0)), 128


def time_fleetrl(model_dir: str, steps: int, tmp: Path, overrides: list[str]) -> list[tuple[float, float]]:
    step, _ = learner_step_fn(model_dir, overrides)
    times = []
    for i in range(steps + 3):
        t, c = time.perf_counter(), time.process_time()
        step()
        if i >= 3:
            times.append((time.perf_counter() - t, time.process_time() - c))
    return times


def time_bare(model_dir: str, steps: int) -> list[tuple[float, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    groups = make_groups(model.config.vocab_size)
    prompts = torch.tensor([g.prompt_array().tolist() for g in groups for _ in range(g.num_responses)])
    responses = torch.tensor([g.response_tokens(i).tolist() for g in groups for i in range(g.num_responses)])
    rewards = torch.tensor([r for g in groups for r in g.rewards])
    input_ids = torch.cat([prompts, responses], 1)  # every sample 6 + 4 tokens: no padding at all
    P, T = prompts.shape[1], responses.shape[1]
    adv = (rewards - rewards.mean()).unsqueeze(1).expand(-1, T)
    times = []
    for i in range(steps + 3):
        t, c = time.perf_counter(), time.process_time()
        logits = model(input_ids=input_ids, use_cache=False).logits[:, P - 1 : P - 1 + T]
        logp = torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        loss = -(adv * logp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 3:
            times.append((time.perf_counter() - t, time.process_time() - c))
    return times


def other_load() -> float:
    """CPU share (in cores) other processes used over one second: figures taken on a busy box are flagged."""
    import psutil

    me = {os.getpid()}
    procs = [p for p in psutil.process_iter() if p.pid not in me]
    before = {}
    for p in procs:
        try:
            before[p.pid] = sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    time.sleep(1.0)
    used = 0.0
    for p in procs:
        try:
            used += sum(p.cpu_times()[:2]) - before.get(p.pid, 0.0)
        except psutil.Error:
            pass
    return round(used, 2)


def compare(before_path: str, after_path: str) -> None:
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    for preset, a in after["presets"].items():
        b = before["presets"][preset]
        print(
            f"{preset:6s} trained samples/s {b['trained_samples_per_s']:7.0f} -> {a['trained_samples_per_s']:7.0f} "
            f"({a['trained_samples_per_s'] / b['trained_samples_per_s']:.2f}x); overhead over bare torch "
            f"{b['overhead']:+.1%} -> {a['overhead']:+.1%}"
        )
        if "trained_samples_per_cpu_s" in a and "trained_samples_per_cpu_s" in b:
            print(
                f"{'':6s} per CPU-second  {b['trained_samples_per_cpu_s']:7.0f} -> {a['trained_samples_per_cpu_s']:7.0f} "
                f"({a['trained_samples_per_cpu_s'] / b['trained_samples_per_cpu_s']:.2f}x); CPU overhead "
                f"{b['cpu_overhead']:+.1%} -> {a['cpu_overhead']:+.1%}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learner_step.json"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of the learner")
    ap.add_argument("--label", default="after", help="name of this measurement in --out (e.g. before / after)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"), help="print after vs before and exit")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    import torch

    from fleetrl.learner.init_model import init_model

    torch.set_num_threads(args.threads)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}",
        "batch": "16 groups x 8 responses, prompt 6 + response 4 tokens",
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = str(init_model(Path(tmp) / preset, preset=preset))
            # interleave the two so that machine noise hits both alike
            ours, bare = [], []
            for _ in range(2):
                bare += time_bare(model_dir, args.steps // 2)
                ours += time_fleetrl(model_dir, args.steps // 2, Path(tmp), args.set)
            o, b = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in bare)
            oc, bc = statistics.median(c for _, c in ours), statistics.median(c for _, c in bare)
            report["presets"][preset] = {
                "fleetrl_step_s": o,
                "bare_torch_step_s": b,
                "overhead": o / b - 1,
                "trained_samples_per_s": 128 / o,
                "fleetrl_cpu_s": oc,
                "bare_torch_cpu_s": bc,
                "cpu_overhead": oc / bc - 1,
                "trained_samples_per_cpu_s": 128 / oc,
            }
            print(
                f"{preset:6s} fleetrl step {1000 * o:7.1f} ms ({128 / o:6.0f} samples/s)   bare torch "
                f"{1000 * b:7.1f} ms   overhead {o / b - 1:+.1%}   | CPU time: fleetrl {1000 * oc:6.1f} ms "
                f"({128 / oc:6.0f} samples/CPU-s), bare {1000 * bc:6.1f} ms, overhead {oc / bc - 1:+.1%}"
            )
    report["label"], report["overrides"] = args.label, args.set
    report["load"] = other_load()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
