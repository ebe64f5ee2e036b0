"""The ``dpo`` objective's step: one optimizer step on preference pairs.

Shape legend: B leased samples, P pairs, n a chunk's pairs.

Offline and online DPO share this step; only the pairs' origin differs:

- online (the rollout fleet): each leased group of G >= 2 responses gives one pair (best vs worst by
  reward); a group whose rewards all tie gives none and is counted in ``dpo/tied_groups`` (set
  ``algorithm.dynamic_sampling`` to lease replacements for them). Staleness and weight sync work as
  for RL; the behaviour log-probs are not needed.
- offline (``data.preference``, learner/preference.py): the source reads (prompt, chosen, rejected)
  token ids itself; no broker, no groups.

    pairs -> PreferenceBatch: chunks of whole pairs, each one micro-batch on the device (batch.py)
    -> summed reference log-probs per chunk (frozen reference, no grad; 0 with reference_free)
    -> per chunk: summed policy log-probs -> PREFERENCE_LOSSES[algorithm.loss], weighted n / P
    -> one engine.step() (learner/update.py)

Log-probs are summed over each response's tokens (DPO's sequence log-likelihood) and follow the
engines' convention (``log_softmax(logits / rollout.temperature)``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fleetrl.common.config.algorithm import DpoAlgorithm
from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import PREFERENCE_LOSSES, PreferenceInputs
from fleetrl.learner.batch import MicroBatch, PairChunk, PreferenceBatch, pack_pairs
from fleetrl.learner.metrics import sample_metrics
from fleetrl.learner.source import Leased
from fleetrl.learner.update import Piece, accumulate_and_step, forward_passes, response_logprobs, sync_max

METRICS = (
    "dpo/loss",
    "dpo/accuracy",
    "dpo/margin",
    "dpo/rewards_chosen",
    "dpo/rewards_rejected",
    "dpo/logp_chosen",
    "dpo/logp_rejected",
)


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


def sequence_sums(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """sum_t log pi(y_t | ...) of every row of ``mb`` under ``model``, ``[b]``."""
    logp, _ = response_logprobs(model, mb, temperature)
    return torch.where(mb.mask > 0, logp, 0.0).sum(-1)


def online_pairs(leased: Leased, max_tokens: int, device: torch.device) -> PreferenceBatch:
    """Best vs worst response of every leased group, with the metrics of all leased samples."""
    rewards, gidx, versions, lengths, truncated, responses, prompts = [], [], [], [], [], [], []
    for gi, g in enumerate(leased.groups):
        tokens, offsets = g.token_array(), g.offsets()
        for i in range(g.num_responses):
            responses.append(tokens[offsets[i] : offsets[i + 1]].astype(np.int64))
            prompts.append(g.prompt_of(i).astype(np.int64))
            rewards.append(g.rewards[i])
            gidx.append(gi)
            versions.append(g.policy_version)
            lengths.append(int(g.lengths[i]))
            truncated.append(g.finish_reason(i) == "length")
    rewards_B, gidx_B = torch.tensor(rewards, dtype=torch.float32), torch.tensor(gidx, dtype=torch.int64)
    chosen, rejected, tied = pairs_from_groups(rewards_B, gidx_B)
    pairs = [(prompts[c], responses[c], responses[r], prompts[r]) for c, r in zip(chosen.tolist(), rejected.tolist())]
    if not pairs:  # nothing to train on: one placeholder keeps the collective passes of other ranks matched
        pairs = [(prompts[0], responses[0], responses[-1], prompts[-1])]
    batch = pack_pairs(
        pairs,
        max_tokens,
        device,
        tied=tied,
        group_ids=[g.group_id for g in leased.groups],
        rewards=rewards_B,
        versions=torch.tensor(versions, dtype=torch.int64),
        truncated=torch.tensor(truncated, dtype=torch.bool),
    )
    batch.num_pairs = chosen.numel()
    batch.lengths, batch.num_samples = torch.tensor(lengths, dtype=torch.int64), len(lengths)
    batch.num_tokens = int(sum(lengths))
    return batch


class DpoActor:
    """The learner's step for ``algorithm.type: dpo`` (same interface as ``PolicyActor``)."""

    def __init__(self, engine, ref_model, cfg: JobConfig, device: torch.device, offline: bool):
        alg: DpoAlgorithm = cfg.algorithm  # type: ignore[assignment]
        if ref_model is None and not alg.reference_free:
            raise ValueError("algorithm.type=dpo needs the frozen reference model (or algorithm.reference_free=true)")
        self.engine, self.ref, self.cfg, self.device, self.alg, self.offline = (
            engine,
            ref_model,
            cfg,
            device,
            alg,
            offline,
        )
        self.loss_fn = PREFERENCE_LOSSES[alg.loss]
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.max_tokens = cfg.learner.max_tokens_per_microbatch

    def plan(self, leased: Leased) -> PreferenceBatch:
        if leased.pairs is not None:  # offline: the source already holds token ids
            return pack_pairs(leased.pairs, self.max_tokens, self.device, group_ids=leased.ids)
        return online_pairs(leased, self.max_tokens, self.device)

    def fill_reference(self, batch: PreferenceBatch) -> None:
        """``chunk.ref_sum`` ``[2n]``: summed reference log-probs in chunk order (zeros when reference-free)."""
        if self.ref is None:
            for c in batch.chunks:
                c.ref_sum = torch.zeros(2 * c.n, device=self.device)
            return
        sums = forward_passes(lambda c: sequence_sums(self.ref, c.mb, self.temperature), batch.chunks, self.device)
        for c, s in zip(batch.chunks, sums):
            c.ref_sum = s[c.rows]

    def step(self, batch: PreferenceBatch, version: int, pristine: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        self.fill_reference(batch)
        t_fwd = time.perf_counter()
        out = self._update(batch)
        out.update(self._batch_metrics(batch, version))
        out["timing/forward_s"] = t_fwd - t0
        out["timing/update_s"] = time.perf_counter() - t_fwd
        return out

    def _update(self, batch: PreferenceBatch) -> dict[str, float]:
        """Backward over chunks of whole pairs, one optimizer step; nothing when no rank has a pair.

        A rank without pairs but with busier peers runs its placeholder chunk at weight 0, so the
        collectives stay matched."""
        P = batch.num_pairs
        if sync_max(P, self.device) == 0:
            return {"actor/grad_norm": 0.0, "dpo/skipped_step": 1.0}

        def loss_fn(c: PairChunk) -> Piece:
            seq = sequence_sums(self.engine, c.mb, self.temperature)[c.rows]  # chunk order: chosen, then rejected
            n, ref = c.n, c.ref_sum
            inp = PreferenceInputs(
                chosen_logp=seq[:n],
                rejected_logp=seq[n:],
                ref_chosen_logp=ref[:n],
                ref_rejected_logp=ref[n:],
                chosen_len=c.lengths[:n],
                rejected_len=c.lengths[n:],
            )
            res = self.loss_fn(inp, self.alg)
            if not P:
                return Piece(res.loss, 0.0, {})
            extra = {
                "dpo/logp_chosen": float(inp.chosen_logp.detach().mean()),
                "dpo/logp_rejected": float(inp.rejected_logp.detach().mean()),
            }
            return Piece(res.loss, n / P, {**res.metrics, **extra})

        result = accumulate_and_step(self.engine, batch.chunks, loss_fn, self.device, self.cfg.learner.zero_stage)
        result["dpo/skipped_step"] = 0.0
        for name in METRICS:  # a rank without pairs still reports every key (ranks average the same keys)
            result.setdefault(name, 0.0)
        result["actor/loss"] = result["dpo/loss"]
        return result

    def _batch_metrics(self, batch: PreferenceBatch, version: int) -> dict[str, float]:
        lengths = batch.lengths.float()
        out = {
            "dpo/pairs": float(batch.num_pairs),
            "dpo/tied_groups": float(batch.tied),
            "actor/lr": float(self.engine.get_lr()[0]),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "batch/samples": float(batch.num_samples or lengths.numel()),
            "batch/groups": float(len(batch.group_ids)),
            "batch/tokens": float(batch.num_tokens),
        }
        if batch.rewards is not None:  # online: what the fleet sampled; offline pairs carry no rewards
            out.update(sample_metrics(batch.rewards, batch.lengths, batch.truncated, batch.versions, version))
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
