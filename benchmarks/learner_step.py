"""Learner step time against a bare torch forward/backward/AdamW step of the same model and batch.

For each preset (tiny, small): one batch of 16 groups x 8 responses (prompts of 6 tokens, responses of
4 tokens, like the demo), timed over several steps after a warm-up:

- ``fleetrl``: ``Actor.step`` on the DeepSpeed engine (ZeRO-0, fp32, CPU): log-probs, GRPO advantages,
  the clipped loss with TIS, backward, clipping, AdamW step, metrics.
- ``bare``: the same model in plain torch: forward, log-softmax/gather, a policy-gradient loss with the
  same advantages, backward, clip_grad_norm_, AdamW step.

    python benchmarks/learner_step.py [--steps 20] [--threads 1]

Figures go to stdout and benchmarks/results/learner_step.json. Target: overhead <= 10% for one rank.
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
        groups.append(m.build_group(f"g{g}", f"0:{g}", 0, rng.integers(7, vocab, 6), responses,
                                    [float(i % 2) for i in range(group_size)]))
    return groups


def time_fleetrl(model_dir: str, steps: int, tmp: Path) -> list[float]:
    from fleetrl.common.config import load_config
    from fleetrl.learner.actor import Actor
    from fleetrl.learner.batch import batch_from_groups
    from fleetrl.learner.runtime import build_engine, init_distributed, load_causal_lm, train_dtype

    import torch

    cfg = load_config(None, [f"model.path={model_dir}", "learner.device=cpu", "learner.lr=1e-5"])
    dist = init_distributed(cfg)
    dtype = train_dtype(cfg, dist.device)
    engine, _, _ = build_engine(load_causal_lm(model_dir, cfg, dtype), cfg, dtype)
    actor = Actor(engine, None, cfg, dist.device, torch.Generator().manual_seed(0))
    batch = batch_from_groups(make_groups(engine.module.config.vocab_size))
    times = []
    for i in range(steps + 3):
        t = time.perf_counter()
        actor.step(batch, 0)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return times


def time_bare(model_dir: str, steps: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.learner.batch import batch_from_groups, micro_batches

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = batch_from_groups(make_groups(model.config.vocab_size))
    (mb,) = micro_batches(batch, torch.arange(batch.size), 1 << 30)
    adv = (batch.rewards - batch.rewards.mean()).unsqueeze(1) * batch.mask
    times = []
    for i in range(steps + 3):
        t = time.perf_counter()
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        sel = torch.gather(logits, 1, mb.logit_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        logp = torch.log_softmax(sel, -1).gather(-1, batch.responses[mb.index, : mb.response_len].unsqueeze(-1)).squeeze(-1)
        mask = batch.mask[mb.index, : mb.response_len]
        loss = -(adv[mb.index, : mb.response_len] * logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learner_step.json"))
    args = ap.parse_args()
    import torch

    from fleetrl.learner.init_model import init_model

    torch.set_num_threads(args.threads)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}",
              "batch": "16 groups x 8 responses, prompt 6 + response 4 tokens", "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = str(init_model(Path(tmp) / preset, preset=preset))
            # interleave the two so that machine noise hits both alike
            ours, bare = [], []
            for _ in range(2):
                bare += time_bare(model_dir, args.steps // 2)
                ours += time_fleetrl(model_dir, args.steps // 2, Path(tmp))
            o, b = statistics.median(ours), statistics.median(bare)
            report["presets"][preset] = {"fleetrl_step_s": o, "bare_torch_step_s": b, "overhead": o / b - 1}
            print(f"{preset:6s} fleetrl step {1000 * o:7.1f} ms   bare torch {1000 * b:7.1f} ms   overhead {o / b - 1:+.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
