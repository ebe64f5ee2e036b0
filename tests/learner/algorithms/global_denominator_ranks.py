"""One rank of the global-denominator check (tests/learner/algorithms/test_global_denominator.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/learner/algorithms/global_denominator_ranks.py \
        --model DIR --zero-stage 0 --out result.json

Each rank takes its own groups (rank 0 three groups, rank 1 one: unequal token and sequence counts),
packs them into several micro-batches and runs ``PolicyActor._update``, the learner's real update: the
DeepSpeed engine, its gradient averaging over ranks, the actor's micro-batch loop. The full gradient
is read inside ``engine.step()``, after DeepSpeed has reduced it over the ranks and before the optimizer
update (``deepspeed.utils.safe_get_full_grad``, every ZeRO stage).
Rank 0 then builds the same model without DeepSpeed, takes the policy loss of the concatenated batch
in one call (no global denominator: the call's own count) and its gradient, and writes, per
``loss_agg`` mode, the largest difference of the two gradients, and that of the old convention (the
mean of the two ranks' own aggregates) for contrast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RANK_GROUPS = ((0, 3), (3, 1))  # (first group, number of groups) of rank 0 and rank 1


def advantages(batch):
    """A per-token advantage that depends only on the sample (its reward) and the position: the same
    under any packing. Zero where masked."""
    import torch

    T = batch.mask.shape[1]
    pos = torch.arange(T, dtype=torch.float32, device=batch.mask.device)
    return ((batch.rewards - 0.5)[:, None] * (1.0 + 0.3 * pos)[None, :]) * batch.mask


def policy_loss(actor, model, batch, temperature):
    """The policy loss of ``batch`` in one call per micro-batch, each over its own count (summed)."""
    from fleetrl.learner.algorithms import LossInputs
    from fleetrl.learner.update import response_logprobs

    total = 0.0
    for mb in batch.micro:
        logp, _ = response_logprobs(model, mb, temperature)
        total = (
            total
            + actor.loss_fn(
                LossInputs(logp=logp, old_logp=logp.detach(), behav_logp=mb.behav_logp, adv=mb.adv, mask=mb.mask),
                actor.alg,
            ).loss
        )
    return total


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    from deepspeed.utils import safe_get_full_grad

    from fleetrl.common.config import load_config
    from fleetrl.learner.actor import PolicyActor
    from fleetrl.learner.batch import pack_groups
    from fleetrl.learner.runtime import build_engine, init_distributed, load_causal_lm
    from tests.learner.conftest import synthetic_groups

    torch.set_num_threads(1)
    groups = synthetic_groups(4, group_size=4, seed=11)
    out: dict[str, dict[str, float]] = {}
    dist = None
    for mode in MODES:
        cfg = load_config(
            str(ROOT / "configs" / "grpo.yaml"),
            [
                f"model.path={args.model}",
                "learner.device=cpu",
                f"learner.zero_stage={args.zero_stage}",
                f"algorithm.loss_agg={mode}",
                "algorithm.kl.placement=none",
                "learner.max_tokens_per_microbatch=40",
                "learner.grad_clip=1000000.0",
                "rollout.max_new_tokens=8",
            ],
        )
        dist = dist or init_distributed(cfg)
        torch.manual_seed(0)
        model = load_causal_lm(args.model, cfg, torch.float32)
        engine, _, _ = build_engine(model, cfg, torch.float32)
        actor = PolicyActor(engine, None, cfg, dist.device, torch.Generator().manual_seed(0))
        first, n = RANK_GROUPS[dist.rank]
        batch = pack_groups(groups[first : first + n], cfg.learner.max_tokens_per_microbatch, dist.device)
        assert len(batch.micro) > 1, "each rank should take several micro-batches"
        batch.scatter("adv", advantages(batch))
        captured: dict[str, torch.Tensor] = {}
        real_model_step = engine._take_model_step

        def model_step(*a, **kw):  # inside engine.step(): after the ranks' gradients are reduced, before the update
            for name, p in engine.module.named_parameters():  # noqa: F821 - runs before the del
                g = safe_get_full_grad(p)
                if g is not None:
                    captured[name] = g.detach().float().clone()
            return real_model_step(*a, **kw)

        engine._take_model_step = model_step
        actor._update(batch.micro)
        if dist.rank == 0:  # one process, no DeepSpeed: the concatenated batch, and each rank's alone
            ref_model = load_causal_lm(args.model, cfg, torch.float32)
            parts = []
            for gs in (groups, *(groups[f : f + k] for f, k in RANK_GROUPS)):
                whole = pack_groups(gs, 10**6, dist.device)
                assert len(whole.micro) == 1
                whole.scatter("adv", advantages(whole))
                parts.append(grads_of(ref_model, policy_loss(actor, ref_model, whole, actor.temperature)))
            reference, own0, own1 = parts
            assert set(captured) == set(reference), (sorted(captured)[:3], sorted(reference)[:3])
            diff = max(float((captured[k] - reference[k]).abs().max()) for k in reference)
            naive = max(float((0.5 * (own0[k] + own1[k]) - reference[k]).abs().max()) for k in reference)
            scale = max(float(reference[k].abs().max()) for k in reference)
            out[mode] = {"max_abs_diff": diff, "old_convention_diff": naive, "max_abs_grad": scale}
        del engine, actor, model
    if dist.rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
