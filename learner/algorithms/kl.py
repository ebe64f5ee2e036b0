"""KL estimators towards the frozen reference model, and the KL coefficient controllers.

Shape legend: B sequences, T padded response positions.

The estimators follow Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html).
Tokens are sampled from pi, so with log r = log pi_ref - log pi per token, each estimates
KL(pi || pi_ref) = E_pi[-log r]:

| name (aliases) | formula | unbiased | always >= 0 |
| --- | --- | --- | --- |
| ``k1`` (``kl``) | -log r = log pi - log pi_ref | yes | no |
| ``k2`` (``mse``) | 1/2 (log r)^2 | no (low bias when KL is small) | yes |
| ``k3`` (``low_var_kl``) | (r - 1) - log r, bounded to [0, 10] | yes (inside the bound) | yes |
| ``abs`` | abs(log r) | no | yes |

A trailing ``+`` (``k1+``, ``k2+``, ``k3+``, ``low_var_kl+``, ``abs+``) is the straight-through form of verl
(after Shah et al. 2025, "On Computation and Design of KL Divergence for RL and RLHF", arXiv
2505.17508): the value of the named estimator and the gradient of k2, whose gradient is the
gradient of KL(pi || pi_ref) to first order, while the value of k1 / k3 is the unbiased one. It only
matters for ``kl.placement: loss`` (a reward penalty carries no gradient).

Every estimator maps ``(logp [B, T], ref_logp [B, T]) -> kl [B, T]``; mask and aggregate outside,
with ``kl_loss`` (which masks the inputs first, so NaN or -inf in padding reaches neither the value
nor the gradient) or as a reward penalty (``apply_kl_penalty``, before advantages).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fleetrl.common.config.algorithm import KlConfig, RlAlgorithm
from fleetrl.common.plugins.registry import Registry
from fleetrl.learner.algorithms.aggregation import aggregate

KlEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KlEstimator] = Registry("KL estimator", config_key="algorithm.kl.estimator")

K3_LOG_RATIO_CLAMP = 20.0
"""k3 clamps log r to [-20, 20] before exp, so exp stays finite in float32 and bfloat16."""
K3_MAX = 10.0
"""k3 is bounded to [0, 10] after that, as verl bounds it: one token where the reference is far more
likely than the policy would otherwise contribute up to e^20 ~ 4.9e8 (a loss of ~5e5 at coef 1e-3)
and dominate the batch and the logged KL the health rules watch. k3 = 10 means log r ~ 2.4 (r ~ 11):
a token that far from the reference is already a signal; inside the bound k3 is exact."""

ADAPTIVE_KL_ERROR_CLIP = 0.2


@KL_ESTIMATORS.register("k1", "kl")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref, ``[B, T]``: unbiased, high variance, can be negative per token."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", "mse")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 1/2 (log pi - log pi_ref)^2, ``[B, T]``: biased, low variance, >= 0.

    Its gradient is the gradient of KL(pi || pi_ref) to first order; as a loss it is the k2 of GRPO
    variants that want a symmetric penalty."""
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(log r) - log r - 1 with log r = clamp(log pi_ref - log pi, -20, 20), bounded to [0, 10], ``[B, T]``.

    Schulman's unbiased, low-variance, non-negative estimator (the KL term of GRPO, Shao et al. 2024,
    arXiv 2402.03300), bounded like verl's ``low_var_kl`` (``K3_MAX``). Computed as
    ``expm1(log r) - log r`` so that tiny |log r| does not round to a negative value in float32.
    """
    log_r = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(log_r) - log_r).clamp(0.0, K3_MAX)


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """abs = |log pi - log pi_ref|, ``[B, T]``: >= 0, biased (TRL's and verl's ``abs``)."""
    return (logp - ref_logp).abs()


def _straight_through(value_fn: KlEstimator) -> KlEstimator:
    def estimator(logp: Tensor, ref_logp: Tensor) -> Tensor:
        """The value of the base estimator with the gradient of k2 (see the module docstring)."""
        grad_path = k2(logp, ref_logp)
        return grad_path - grad_path.detach() + value_fn(logp, ref_logp).detach()

    return estimator


for _names, _fn in ((("k1+", "kl+"), k1), (("k2+", "mse+"), k2), (("k3+", "low_var_kl+"), k3), (("abs+",), abs_kl)):
    KL_ESTIMATORS.register(*_names)(_straight_through(_fn))


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    estimator: str,
    loss_agg: str,
    norm_len: int | None = None,
    denom: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(aggregated KL loss, per-token KL ``[B, T]``) of ``estimator`` over valid tokens (``kl.placement: loss``);
    ``denom``: the global count to aggregate over (see ``aggregate``).

    Padding is replaced by 0 before the estimator, so a NaN or -inf log-prob there reaches neither
    the value nor the gradient (``where`` after a nonlinearity would still pass 0 * NaN back).
    """
    valid = mask.to(torch.bool)
    kl = KL_ESTIMATORS[estimator](torch.where(valid, logp, 0.0), torch.where(valid, ref_logp, 0.0))
    return aggregate(kl, mask, loss_agg, norm_len, denom), kl


def apply_kl_penalty(token_rewards: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token reward penalty r_t - coef * kl_t on valid tokens (``kl.placement: reward``), ``[B, T]``.

    Apply it before the advantage estimator (Ouyang et al. 2022, arXiv 2203.02155; Ziegler et al.
    2019). ``kl`` should be detached: the penalty is data, not a gradient path. Padding is selected
    away, so a non-finite ``kl`` there changes no reward.
    """
    return token_rewards - coef * torch.where(mask.to(torch.bool), kl.detach(), 0.0)


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl.adaptive: null``)."""

    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, n_samples: int) -> None:
        """No-op; kept so the learner calls every controller the same way."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. 2019 (arXiv 1909.08593):

        e      = clip(KL / KL_target - 1, -0.2, 0.2)
        beta  <- beta * (1 + e * n / H)

    where n is the number of samples in the update and H the horizon in samples: the coefficient
    moves by at most 20% per H samples. Above target the coefficient grows, below it shrinks.
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        """Move the coefficient after a step whose mean KL was ``current_kl`` over ``n_samples`` samples."""
        error = min(max(current_kl / self.target - 1.0, -ADAPTIVE_KL_ERROR_CLIP), ADAPTIVE_KL_ERROR_CLIP)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


def kl_controller_from_config(cfg: KlConfig | RlAlgorithm) -> FixedKLController | AdaptiveKLController:
    """The controller ``algorithm.kl`` asks for; accepts the ``kl`` section or the whole ``algorithm``."""
    kl_cfg = cfg.kl if isinstance(cfg, RlAlgorithm) else cfg
    if kl_cfg.adaptive is None:
        return FixedKLController(kl_cfg.coef)
    return AdaptiveKLController(kl_cfg.coef, kl_cfg.adaptive.target, kl_cfg.adaptive.horizon)
