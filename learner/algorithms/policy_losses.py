"""Policy losses: ``LossInputs -> LossOutputs``, looked up by ``algorithm.policy_loss``.

Shape legend: B sequences, T padded response positions.

Every loss has one signature::

    out = POLICY_LOSSES[name](LossInputs(logp, old_logp, behav_logp, adv, mask, agg_denom), cfg)  # cfg: RlAlgorithm

and returns the aggregated scalar (``cfg.loss_agg``, ``cfg.loss_agg_norm_len``; divided by the global
count ``agg_denom`` when the caller gives one, see aggregation.py) and metrics, always
with the same keys: ``actor/pg_loss``, ``actor/clipfrac``, ``actor/dual_clipfrac``, ``actor/approx_kl``,
``actor/ratio_min|mean|max`` and the ``off_policy/*`` keys of ``off_policy_metrics``. The KL-to-reference
term and the entropy bonus are added by the caller, not here.

The clipped objective per token (PPO, Schulman et al. 2017, arXiv 1707.06347, Eq. 7; asymmetric
clip of DAPO, Yu et al. 2025, arXiv 2503.14476; dual clip of Ye et al. 2020, arXiv 1912.09729):

    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
    l_t = min(l_t, -c A_t)          where A_t < 0 and dual_clip c is set
    loss = aggregate(w_t * l_t)     w_t = off-policy weight (see off_policy.py)

Log-ratios are clamped to [-20, 20] before exp (``LOG_RATIO_CLAMP``), so the loss and its gradient
stay finite for any input; a token that far off is clipped by the objective anyway. Masked positions
are replaced by 0 before exp, so -inf or NaN log-probs in padding reach neither loss nor gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.common.plugins.registry import Registry
from fleetrl.learner.algorithms.aggregation import aggregate
from fleetrl.learner.algorithms.common import masked_mean, masked_min_mean_max, to_floats
from fleetrl.learner.algorithms.kl import k3
from fleetrl.learner.algorithms.off_policy import BehaviourWeights, behaviour_weights, off_policy_metrics
from fleetrl.learner.algorithms.structs import LossInputs, LossOutputs

PolicyLoss = Callable[[LossInputs, RlAlgorithm], LossOutputs]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", config_key="algorithm.policy_loss")

LOG_RATIO_CLAMP = 20.0


def clipped_objective(
    log_ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-token clipped surrogate (see the module docstring), all ``[B, T]``.

    Returns (loss l_t, clipped: the clipped term is active, dual_clipped: the -c A bound is active,
    ratio r_t).
    """
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is None:
        return loss, is_clipped, torch.zeros_like(is_clipped), ratio
    bound = -adv * dual_clip
    is_dual = (adv < 0) & (loss > bound)
    return torch.where(is_dual, bound, loss), is_clipped, is_dual, ratio


def _outputs(
    inp: LossInputs, cfg: RlAlgorithm, log_ratio: Tensor, clip: tuple[float, float], bw: BehaviourWeights
) -> LossOutputs:
    """Clip, weight, aggregate and measure: the part every clipped loss shares."""
    adv = inp.adv.detach()
    token_loss, is_clipped, is_dual, ratio = clipped_objective(log_ratio, adv, *clip, cfg.dual_clip)
    weighted = token_loss * bw.weight
    loss = aggregate(weighted, inp.mask, cfg.loss_agg, cfg.loss_agg_norm_len, inp.agg_denom)
    own = loss if inp.agg_denom is None else aggregate(weighted.detach(), inp.mask, cfg.loss_agg, cfg.loss_agg_norm_len)
    ratio_min, ratio_mean, ratio_max = masked_min_mean_max(ratio.detach(), inp.mask)
    dtype = ratio.dtype
    metrics = {
        "actor/pg_loss": own,  # this micro-batch's own aggregate, whatever the denominator
        "actor/clipfrac": masked_mean(is_clipped.to(dtype), inp.mask),
        "actor/dual_clipfrac": masked_mean(is_dual.to(dtype), inp.mask),
        "actor/approx_kl": masked_mean(k3(inp.old_logp.detach(), inp.logp.detach()), inp.mask),
        "actor/ratio_min": ratio_min,
        "actor/ratio_mean": ratio_mean,
        "actor/ratio_max": ratio_max,
        **off_policy_metrics(inp.logp, inp.behav_logp, bw, inp.mask, cfg.off_policy.mode),
    }
    return LossOutputs(loss=loss, metrics=to_floats(metrics))


def _token_clip_loss(inp: LossInputs, cfg: RlAlgorithm, loss: str) -> LossOutputs:
    valid = inp.mask.to(torch.bool)
    log_ratio = torch.where(valid, inp.logp - inp.old_logp.detach(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    bw = behaviour_weights(inp.old_logp, inp.behav_logp, inp.mask, cfg.off_policy)
    return _outputs(inp, cfg, log_ratio, cfg.clip_bounds(loss), bw)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(inp: LossInputs, cfg: RlAlgorithm) -> LossOutputs:
    """PPO's clipped surrogate per token, r_t = pi_theta / pi_old (Schulman et al. 2017, Eq. 7).

    Config: ``clip_low`` / ``clip_high`` (default 0.2 / 0.2, from ``CLIP_DEFAULTS``), ``dual_clip`` (off), ``loss_agg``,
    ``off_policy.{mode, level, cap}``.
    """
    return _token_clip_loss(inp, cfg, "ppo_clip")


@POLICY_LOSSES.register("dapo")
def dapo(inp: LossInputs, cfg: RlAlgorithm) -> LossOutputs:
    """DAPO's clip-higher objective (Yu et al. 2025, arXiv 2503.14476, "Clip-Higher"): the PPO clip with
    eps_low 0.2 / eps_high 0.28 by default, so low-probability tokens can grow (against entropy
    collapse). The paper aggregates with ``loss_agg: token-mean`` (the default); the other DAPO pieces
    (dynamic sampling, overlong shaping) live in dapo.py.
    """
    return _token_clip_loss(inp, cfg, "dapo")


@POLICY_LOSSES.register("gspo")
def gspo(inp: LossInputs, cfg: RlAlgorithm) -> LossOutputs:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071), token form
    (the paper's GSPO-token variant):

        log s_i   = 1/|y_i| sum_t (log pi_theta(y_it) - log pi_old(y_it))     (sequence-level ratio)
        log s_it  = sg[log s_i] + log pi_theta(y_it) - sg[log pi_theta(y_it)]

    s_it has the value of s_i (so clipping acts per sequence) and the gradient s_i * grad log pi(y_it),
    which equals the sequence form's gradient when A is constant over the sequence. Default clip
    3e-4 / 4e-4; the paper aggregates with ``loss_agg: seq-mean-token-mean``. The off-policy weight is
    per sequence, in the same length-normalised form: log rho_i = mean_t (old_it - mu_it); with
    ``off_policy.gspo_level: token`` it is per token instead (token-level TIS: log rho_it = old_it - mu_it),
    while the clipped ratio stays per sequence.
    """
    m = inp.mask.to(inp.logp.dtype)
    token_log_ratio = torch.where(m > 0, inp.logp.detach() - inp.old_logp.detach(), 0.0)
    seq_log_ratio = token_log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(m > 0, seq_log_ratio + inp.logp - inp.logp.detach(), 0.0)
    bw = behaviour_weights(
        inp.old_logp, inp.behav_logp, inp.mask, cfg.off_policy, level=cfg.off_policy.gspo_level, seq_reduce="mean"
    )
    return _outputs(inp, cfg, log_ratio, cfg.clip_bounds("gspo"), bw)
