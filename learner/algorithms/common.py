"""Shared math: masked statistics, per-group statistics, entropy, the clipped value loss.

Shape legend: B sequences, T padded response positions, V vocabulary; ``mask`` is ``[B, T]`` bool or
0/1. Every function here is vectorised over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fleetrl.learner.algorithms.aggregation import aggregate
from fleetrl.learner.algorithms.structs import LossOutputs

WHITEN_EPS = 1e-8


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set (0 where nothing is set)."""
    m = mask.to(x.dtype)
    x = torch.where(m > 0, x, 0.0)
    if dim is None:
        return x.sum() / m.sum().clamp_min(1)
    return x.sum(dim) / m.sum(dim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked-in positions (Bessel-corrected when ``unbiased`` and n > 1)."""
    m = mask.to(x.dtype)
    n = m.sum()
    centred = torch.where(m > 0, x - masked_mean(x, m), 0.0)
    denom = (n - 1).clamp_min(1) if unbiased else n.clamp_min(1)
    return centred.square().sum() / denom


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid positions; zero where masked.

    ``shift_mean=False`` only rescales. An empty mask gives zeros; a single valid value gives 0.
    """
    m = mask.to(x.dtype)
    centred = x - masked_mean(x, m) if shift_mean else x
    return torch.where(m > 0, centred * torch.rsqrt(masked_var(x, m) + eps), 0.0)


def masked_min_mean_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(min, mean, max) of ``x`` over valid positions; all 0 when no position is valid."""
    valid = mask.to(torch.bool)
    any_valid = valid.any()
    lo = torch.where(valid, x, torch.inf).amin()
    hi = torch.where(valid, x, -torch.inf).amax()
    zero = x.new_zeros(())
    return torch.where(any_valid, lo, zero), masked_mean(x, valid), torch.where(any_valid, hi, zero)


def to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """0-d tensors -> floats with one device sync for the whole dict."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values))


@dataclass(frozen=True)
class GroupStats:
    """Statistics of the group each sample belongs to, gathered back per sample (every field ``[B]``).

    Attributes:
        count: group size n_g.
        mean: group mean of the value.
        std: unbiased group standard deviation (0 for a group of one).
        no_signal: True where the group cannot give a baseline: a group of one, or all values equal.
    """

    count: Tensor
    mean: Tensor
    std: Tensor
    no_signal: Tensor


def group_stats(x_B: Tensor, group_index_B: Tensor) -> GroupStats:
    """Per-group count / mean / unbiased std / no-signal flag of ``x_B`` ``[B]``, gathered back to ``[B]``.

    ``group_index_B`` ``[B]`` holds any integer ids (same id = same prompt); no Python loop over groups.
    "All values equal" is decided exactly (group max == group min), not by a tolerance on the std.
    """
    ids_G, inv_B = torch.unique(group_index_B, return_inverse=True)
    n_groups = ids_G.numel()
    zeros_G = x_B.new_zeros(n_groups)
    count_G = zeros_G.index_add(0, inv_B, torch.ones_like(x_B))
    mean_G = zeros_G.index_add(0, inv_B, x_B) / count_G.clamp_min(1)
    sq_dev_G = zeros_G.index_add(0, inv_B, (x_B - mean_G[inv_B]).square())
    std_G = (sq_dev_G / (count_G - 1).clamp_min(1)).sqrt()
    detached_B = x_B.detach()
    hi_G = zeros_G.detach().scatter_reduce(0, inv_B, detached_B, "amax", include_self=False)
    lo_G = zeros_G.detach().scatter_reduce(0, inv_B, detached_B, "amin", include_self=False)
    no_signal_G = (count_G < 2) | (hi_G == lo_G)
    return GroupStats(count_G[inv_B], mean_G[inv_B], std_G[inv_B], no_signal_G[inv_B])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(``logits``) over the last dim: ``[..., V]`` -> ``[...]``.

    Computed from ``log_softmax`` (stable for large logits). Logits of -inf (masked vocabulary, top-k
    filtering) have p = 0 and contribute 0, as in the limit p log p -> 0: their log p is replaced by 0
    before the product, so neither the value nor the gradient sees 0 * inf. Upcast bf16 logits to
    float32 first if you need the entropy to better than ~1e-2.
    """
    logp = torch.log_softmax(logits, dim=-1)
    safe_logp = torch.where(torch.isneginf(logp), 0.0, logp)
    return -(logp.exp() * safe_logp).sum(-1)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float,
    loss_agg: str = "token-mean",
    norm_len: int | None = None,
    denom: float | None = None,
) -> LossOutputs:
    """Clipped value loss of PPO's critic (Schulman et al. 2017, arXiv 1707.06347, Eq. 9 and the
    value clipping of the OpenAI baselines implementation), for ``adv_estimator: gae``.

        V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
        l_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)

    Args:
        values: ``[B, T]`` current value predictions V (carry gradient).
        old_values: ``[B, T]`` V_old, the predictions the returns were computed with.
        returns: ``[B, T]`` targets R (GAE returns).
        mask: ``[B, T]`` valid response tokens.
        clip_range: eps_v (``algorithm.critic.cliprange_value``).
        loss_agg, norm_len, denom: see ``aggregate`` (``denom``: the global count; ``critic/value_loss``
            stays this call's own aggregate).

    Returns:
        ``LossOutputs`` with ``critic/value_loss``, ``critic/clipfrac`` (share of tokens where the clipped
        term is the larger one) and ``critic/vpred_mean``.
    """
    valid = mask.to(torch.bool)  # padding is replaced first: NaN there reaches neither the loss nor the gradient
    values = torch.where(valid, values, 0.0)
    old_values, returns = torch.where(valid, old_values.detach(), 0.0), torch.where(valid, returns.detach(), 0.0)
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns).square()
    loss_clipped = (clipped - returns).square()
    per_token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = aggregate(per_token_loss, mask, loss_agg, norm_len, denom)
    shown = loss if denom is None else aggregate(per_token_loss.detach(), mask, loss_agg, norm_len)
    metrics = {
        "critic/value_loss": shown,
        "critic/clipfrac": masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask),
        "critic/vpred_mean": masked_mean(values, mask),
    }
    return LossOutputs(loss=loss, metrics=to_floats(metrics))
