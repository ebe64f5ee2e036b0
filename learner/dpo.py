"""DPO in the learner (``algorithm.policy_loss: dpo``): one optimizer step on preference pairs.

Shape legend: B samples in the batch, P pairs, T response positions.

Offline and online DPO share this step. A pair is a group's best and worst response by reward:

- online (the rollout fleet): each leased group of G >= 2 responses gives one pair (best vs worst);
  a group whose rewards all tie gives none and is counted in ``dpo/tied_groups`` (turn on
  ``algorithm.dynamic_sampling`` to lease replacements for them). Staleness and weight sync work as
  for GRPO; the behaviour log-probs are not needed.
- offline (``data.preference``, learner/preference.py): every pair arrives as a group of two
  responses, chosen with reward 1 and rejected with reward 0.

    ref log-prob sums of the paired responses (frozen reference, no grad)
    -> chunks of whole pairs (token budget) -> summed policy log-probs -> PREFERENCE_LOSSES[dpo.loss]
    -> engine.backward per chunk, weighted by its share of the pairs -> engine.step()

Log-probs are summed over each response's tokens (DPO's sequence log-likelihood) and follow the
actor's convention (``log_softmax(logits / rollout.temperature)``).
"""

from __future__ import annotations

import sys
import time

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.actor import _reduce, _sync_max, response_logprobs
from fleetrl.learner.algorithms import PREFERENCE_LOSSES, PreferenceInputs, kl_controller_from_config
from fleetrl.learner.batch import Batch, micro_batches

METRICS = ("dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/rewards_chosen", "dpo/rewards_rejected",
           "dpo/logp_chosen", "dpo/logp_rejected")


def pairs_from_groups(rewards_B: torch.Tensor, group_index_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chosen [P], rejected [P], tied groups): per group the first best and the first worst sample.

    A group whose rewards are all equal (including a group of one) gives no pair and counts as tied.
    """
    chosen, rejected, tied = [], [], 0
    for g in torch.unique(group_index_B).tolist():
        members = (group_index_B == g).nonzero().squeeze(-1)
        r = rewards_B[members]
        if members.numel() < 2 or bool(r.max() == r.min()):
            tied += 1
            continue
        chosen.append(int(members[int(torch.argmax(r))]))
        rejected.append(int(members[int(torch.argmin(r))]))
    return torch.tensor(chosen, dtype=torch.int64), torch.tensor(rejected, dtype=torch.int64), tied


def sequence_logprobs(model, batch: Batch, temperature: float, device: torch.device, max_tokens: int,
                      collective: bool = True) -> torch.Tensor:
    """sum_t log pi(y_t | ...) of every response of ``batch`` under ``model``, ``[B]`` (no grad).

    ``collective``: every rank runs the same number of forwards (ZeRO-3); False for rank-0-only passes.
    """
    out = torch.zeros(batch.size)
    mbs = micro_batches(batch, torch.arange(batch.size), max_tokens)
    n = _sync_max(len(mbs), device) if collective else len(mbs)
    with torch.no_grad():
        for k in range(n):
            mb = mbs[min(k, len(mbs) - 1)]
            logp = response_logprobs(model, mb, temperature, device, entropy=False).logp
            if k < len(mbs):
                mask = batch.mask[mb.index, : mb.response_len].to(device) > 0
                out[mb.index] = torch.where(mask, logp, 0.0).sum(-1).float().cpu()
    return out


def pair_chunks(batch: Batch, n_pairs: int, max_tokens: int) -> list[torch.Tensor]:
    """Pair indices ``0..P-1`` split into runs whose 2k sequences fit ``max_tokens`` padded tokens.

    ``batch`` holds the P chosen responses first, then the P rejected ones. A pair longer than the
    budget gets a chunk of its own.
    """
    length = [len(batch.prompts[i]) + int(batch.lengths[i]) for i in range(batch.size)]
    chunks, current, longest = [], [], 0
    for p in range(n_pairs):
        pair_len = max(length[p], length[n_pairs + p])
        if current and 2 * (len(current) + 1) * max(longest, pair_len) > max_tokens:
            chunks.append(torch.tensor(current))
            current, longest = [], 0
        current.append(p)
        longest = max(longest, pair_len)
    if current:
        chunks.append(torch.tensor(current))
    return chunks


class DpoActor:
    """The learner's step for ``policy_loss: dpo`` (same interface as ``Actor``: ``step``, ``kl_ctl``)."""

    def __init__(self, engine, ref_model, cfg: JobConfig, device: torch.device, generator: torch.Generator,
                 offline: bool):
        if ref_model is None:
            raise ValueError("policy_loss: dpo needs the frozen reference model")
        self.engine, self.ref, self.cfg, self.device, self.gen = engine, ref_model, cfg, device, generator
        self.alg, self.offline = cfg.algorithm, offline
        self.loss_fn = PREFERENCE_LOSSES[cfg.algorithm.dpo.loss]
        self.kl_ctl = kl_controller_from_config(self.alg)  # unused by DPO; saved with checkpoints like the Actor's
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.max_tokens = cfg.learner.max_tokens_per_microbatch

    def step(self, batch: Batch, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        chosen, rejected, tied = pairs_from_groups(batch.rewards, batch.group_index)
        P = chosen.numel()
        pb = batch.select(torch.cat([chosen, rejected])) if P else batch.select(torch.arange(min(2, batch.size)))
        ref_sum = sequence_logprobs(self.ref, pb, self.temperature, self.device, self.max_tokens)
        chunks = pair_chunks(pb, P, self.max_tokens)
        t_fwd = time.perf_counter()
        out = self._update(pb, P, ref_sum, chunks)
        out.update(self._batch_metrics(batch, version, P, tied))
        out["timing/forward_s"] = t_fwd - t0
        out["timing/update_s"] = time.perf_counter() - t_fwd
        return out

    def _update(self, pb: Batch, P: int, ref_sum: torch.Tensor, chunks: list[torch.Tensor]) -> dict[str, float]:
        """Backward over chunks of whole pairs, one optimizer step; nothing when no rank has a pair."""
        n_chunks = _sync_max(len(chunks), self.device)
        if n_chunks == 0:
            return {"actor/grad_norm": 0.0, "dpo/skipped_step": 1.0}
        part: dict[str, list[tuple[float, float]]] = {}
        t_bwd = 0.0
        for k in range(n_chunks):
            dummy = k >= len(chunks)  # another rank has more chunks: a zero-weight pass keeps collectives matched
            if dummy:
                n, idx = 1, torch.tensor([0, pb.size - 1])
            else:
                n, idx = chunks[k].numel(), torch.cat([chunks[k], chunks[k] + P])
            mb = micro_batches(pb, idx, sys.maxsize)[0]  # one forward for the chunk's 2n sequences
            fwd = response_logprobs(self.engine, mb, self.temperature, self.device, entropy=False)
            mask = pb.mask[mb.index, : mb.response_len].to(self.device) > 0
            seq = torch.where(mask, fwd.logp, 0.0).sum(-1)
            row = {int(i): r for r, i in enumerate(mb.index.tolist())}
            seq = seq[torch.tensor([row[int(i)] for i in idx], device=seq.device)]
            ref = ref_sum[idx].to(seq.device)
            inp = PreferenceInputs(chosen_logp=seq[:n], rejected_logp=seq[n:], ref_chosen_logp=ref[:n],
                                   ref_rejected_logp=ref[n:])
            res = self.loss_fn(inp, self.alg)
            share = 0.0 if dummy else n / P
            t = time.perf_counter()
            self.engine.backward(res.loss * share, scale_wrt_gas=False)
            t_bwd += time.perf_counter() - t
            if not dummy:
                extra = {"dpo/logp_chosen": float(inp.chosen_logp.detach().mean()),
                         "dpo/logp_rejected": float(inp.rejected_logp.detach().mean())}
                for name, value in {**res.metrics, **extra}.items():
                    part.setdefault(name, []).append((value, share))
        local_norm = self._local_grad_norm() if self.cfg.learner.zero_stage == 0 else None
        t = time.perf_counter()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        result = {name: _reduce(name, [v for v, _ in vs], [s for _, s in vs]) for name, vs in part.items()}
        result.update({"actor/grad_norm": float(norm) if norm is not None else local_norm, "dpo/skipped_step": 0.0,
                       "timing/step_s": time.perf_counter() - t, "timing/backward_s": t_bwd})
        for name in METRICS:  # a rank without pairs still reports every key (ranks average the same keys)
            result.setdefault(name, 0.0)
        result["actor/loss"] = result["dpo/loss"]
        return result

    def _local_grad_norm(self) -> float:
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def _batch_metrics(self, batch: Batch, version: int, pairs: int, tied: int) -> dict[str, float]:
        out = {
            "dpo/pairs": float(pairs),
            "dpo/tied_groups": float(tied),
            "actor/lr": float(self.engine.get_lr()[0]),
            "response/length_mean": float(batch.lengths.float().mean()),
            "response/length_max": float(batch.lengths.max()),
            "batch/samples": float(batch.size),
            "batch/groups": float(len(batch.group_ids)),
            "batch/tokens": float(batch.num_tokens),
        }
        if not self.offline:  # offline rewards are the 1 / 0 labels of the pairs: nothing to report
            lag = (version - batch.versions).clamp(min=0).float()
            out.update({
                "reward/mean": float(batch.rewards.mean()),
                "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
                "reward/max": float(batch.rewards.max()),
                "reward/min": float(batch.rewards.min()),
                "response/truncated_frac": float(batch.truncated.float().mean()),
                "off_policy/staleness_mean": float(lag.mean()),
                "off_policy/staleness_max": float(lag.max()),
            })
        return out
