"""Off-policy correction: importance weights between the learner's old (or proximal) policy and the
rollout engine's behaviour policy mu, and the metrics that say how far off-policy a batch is.

Shape legend: B sequences, T padded response positions.

With rho = pi_old / mu (per token, or per sequence), ``algorithm.off_policy.mode`` picks the weight w
that multiplies the clipped per-token policy objective:

| mode | ratio in the PPO clip | weight w (detached) | reference |
| --- | --- | --- | --- |
| ``none`` | pi_theta / pi_old | 1 | PPO (Schulman et al. 2017) |
| ``tis`` | pi_theta / pi_old | min(rho, C) | Yao et al. 2025, "Your efficient RL framework secretly brings |
| | | | you off-policy RL training" (verl's TIS) |
| ``decoupled`` | pi_theta / pi_prox | rho = pi_prox / mu, 0 where rho > C | Hilton et al. 2021 (arXiv 2110.00641); |
| | | | AReaL, Fu et al. 2025 (arXiv 2505.24298) |

``off_policy.batch_normalize`` divides the applied weights by their mean over the loss call (a
micro-batch), so they average 1 and only reweigh samples against each other (the self-normalised
importance sampling estimator; verl's batch-normalised rollout IS weights). At ``level: token`` the
mean is over valid tokens; at ``level: sequence`` it is over non-empty sequences (each sequence's one
weight counts once, whatever its length), as verl does. The
normalisation is per micro-batch: with the default token budget one step is one micro-batch.

``decoupled`` follows AReaL's ``ppo_actor_loss_fn``: tokens whose behaviour weight exceeds the cap get
weight 0 but stay in the aggregation's denominator (the ``behav_imp_weight_cap`` filter). Levels:
``token`` uses log rho_t = old_t - mu_t; ``sequence`` uses log rho_i = sum_t (old_it - mu_it) for every
token of sequence i (or the mean over t, the geometric form GSPO uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fleetrl.common.config.algorithm import OffPolicyConfig
from fleetrl.learner.algorithms.common import masked_mean
from fleetrl.learner.algorithms.kl import k3

LOG_WEIGHT_CLAMP = 20.0
"""Bound on |log rho| for the raw weights that are only reported (mode none): finite in any dtype."""


@dataclass(frozen=True)
class BehaviourWeights:
    """Importance weights of one batch; every field is ``[B, T]`` and detached.

    Attributes:
        weight: w applied to the per-token objective (1 in mode ``none``).
        rho: the raw pi_old / mu (log clamped to +-20), for metrics.
        capped: True where rho > C (truncated in ``tis``, dropped in ``decoupled``).
    """

    weight: Tensor
    rho: Tensor
    capped: Tensor


def _no_weight(log_rho: Tensor, log_cap: float) -> Tensor:
    return torch.ones_like(log_rho)


def _truncate(log_rho: Tensor, log_cap: float) -> Tensor:
    """min(rho, C), computed as exp(min(log rho, log C)) so a huge rho never overflows."""
    return log_rho.clamp(max=log_cap).exp()


def _drop_above_cap(log_rho: Tensor, log_cap: float) -> Tensor:
    """rho where rho <= C, else 0 (AReaL's behaviour-importance-weight cap)."""
    return torch.where(log_rho > log_cap, 0.0, log_rho.clamp(max=log_cap).exp())


WEIGHT_RULES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "none": _no_weight,
    "tis": _truncate,
    "decoupled": _drop_above_cap,
}


def log_importance_ratio(
    old_logp: Tensor, behav_logp: Tensor, mask: Tensor, level: str, seq_reduce: str = "sum"
) -> Tensor:
    """log rho ``[B, T]``: old - mu per token (``level="token"``), or per sequence broadcast to its
    tokens (``level="sequence"``: the sum over valid tokens, or their mean with ``seq_reduce="mean"``)."""
    m = mask.to(old_logp.dtype)
    log_rho = torch.where(m > 0, old_logp.detach() - behav_logp.detach(), 0.0)
    if level == "token":
        return log_rho
    per_seq = log_rho.sum(-1, keepdim=True)
    if seq_reduce == "mean":
        per_seq = per_seq / m.sum(-1, keepdim=True).clamp_min(1)
    return per_seq.expand_as(log_rho)


def _batch_mean(weight: Tensor, mask: Tensor, level: str) -> Tensor:
    """The mean ``batch_normalize`` divides by: over valid tokens (``token``), or over non-empty
    sequences of each sequence's weight (``sequence``; the weight is one value per sequence)."""
    if level != "sequence":
        return masked_mean(weight, mask)
    m = mask.to(weight.dtype)
    n_B = m.sum(-1)
    seq_w_B = torch.where(m > 0, weight, 0.0).sum(-1) / n_B.clamp_min(1)
    non_empty_B = (n_B > 0).to(weight.dtype)
    return (seq_w_B * non_empty_B).sum() / non_empty_B.sum().clamp_min(1)


def behaviour_weights(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    cfg: OffPolicyConfig,
    level: str | None = None,
    seq_reduce: str = "sum",
) -> BehaviourWeights:
    """The weights of ``cfg.mode`` at ``level`` (default ``cfg.level``), cap ``cfg.cap``; all ``[B, T]``."""
    log_rho = log_importance_ratio(old_logp, behav_logp, mask, level or cfg.level, seq_reduce)
    log_cap = math.log(cfg.cap)
    weight = WEIGHT_RULES[cfg.mode](log_rho, log_cap)
    if cfg.batch_normalize and cfg.mode != "none":
        weight = weight / _batch_mean(weight, mask, level or cfg.level).clamp_min(torch.finfo(weight.dtype).tiny)
    return BehaviourWeights(
        weight=weight,
        rho=log_rho.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP).exp(),
        capped=log_rho > log_cap,
    )


def effective_sample_size(w: Tensor, mask: Tensor) -> Tensor:
    """Normalised ESS (sum w)^2 / (n * sum w^2) over valid tokens, in (0, 1]; 1 = all weights equal
    (Kong 1992). 0 when every weight is 0 or nothing is valid."""
    m = mask.to(w.dtype)
    w = torch.where(m > 0, w, 0.0)
    return w.sum().square() / (m.sum() * w.square().sum()).clamp_min(torch.finfo(w.dtype).tiny)


def off_policy_metrics(
    logp: Tensor, behav_logp: Tensor, bw: BehaviourWeights, mask: Tensor, mode: str
) -> dict[str, Tensor]:
    """``off_policy/*`` metrics (0-d tensors), over valid tokens:

    - ``drift_kl``: k3 estimate of KL(mu || pi_theta) on the sampled tokens, against the weights being
      trained: the policy drift of stale tokens plus any engine mismatch (``mismatch_sums`` separates
      the engine's part).
    - ``is_weight_mean``, ``is_ess``: of the applied weights w; in mode ``none`` of the raw rho
      (what a correction would have to undo).
    - ``is_capped_frac``: share of tokens with rho > C.
    """
    shown = bw.rho if mode == "none" else bw.weight
    return {
        "off_policy/drift_kl": masked_mean(k3(behav_logp.detach(), logp.detach()), mask),
        "off_policy/is_weight_mean": masked_mean(shown, mask),
        "off_policy/is_ess": effective_sample_size(shown, mask),
        "off_policy/is_capped_frac": masked_mean(bw.capped.to(shown.dtype), mask),
    }


def mismatch_sums(
    old_logp: Tensor, behav_logp: Tensor, mask: Tensor, token_versions: Tensor, version: int
) -> tuple[Tensor, Tensor]:
    """Engine mismatch, like with like: the summed k3 estimate of KL(mu || pi) and the count, over the valid
    tokens of the samples that policy version ``version`` sampled from start to end, where ``old_logp``
    ``[B, T]`` are the learner's log-probs under exactly the weights it published as ``version``.
    ``token_versions`` ``[B, T]`` int.

    A whole sample, not a token: a token sampled after an in-flight update still attends to keys and values
    the older weights computed (``rollout.inflight_update: keep``), so only a sample with every trained token
    of ``version`` ran entirely on those weights. On those the engine and the learner ran the same weights,
    so any gap is the engine's numerics or a broken weight sync, never staleness (policy drift is
    ``drift_kl``). Two 0-d tensors, so callers can sum over micro-batches and ranks before dividing.
    """
    valid = mask > 0
    pure = (~valid | (token_versions == version)).all(-1, keepdim=True)  # [B, 1]
    fresh = valid & pure
    kl = k3(behav_logp.detach(), old_logp.detach())
    return torch.where(fresh, kl, 0.0).sum(), fresh.sum().to(kl.dtype)
