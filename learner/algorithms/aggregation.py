"""Loss aggregation: how a ``[B, T]`` matrix of per-token losses becomes one number.

Shape legend: B sequences, T padded response positions; ``mask`` is ``[B, T]`` bool or 0/1.
A sequence "counts" when it has at least one valid token, so fully masked rows (padding, filtered
samples) never dilute a mean. Every mode is a weighted sum of token losses, so the choice only
changes how much each token weighs:

| mode | weight of token t of sequence i | paper |
| --- | --- | --- |
| ``token-mean`` | 1 / (valid tokens in the batch) | DAPO (Yu et al. 2025, arXiv 2503.14476), token-level loss |
| ``seq-mean-token-sum`` | 1 / (valid sequences) | REINFORCE-style sequence sum |
| ``seq-mean-token-mean`` | 1 / (valid sequences * |y_i|) | GRPO (Shao et al. 2024, arXiv 2402.03300) objective; GSPO |
| ``seq-mean-token-sum-norm`` | 1 / (valid sequences * L) | Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) |

L is a fixed length (``algorithm.loss_agg_norm_len``, normally ``rollout.max_new_tokens``).

**A global denominator.** ``aggregate(..., denom=N)`` divides this call's weighted sum by ``N`` instead
of its own count: the valid tokens (``token-mean``) or the valid sequences (the ``seq-mean-*`` modes)
of the whole optimizer step, over every micro-batch and rank (``global_counts``). The results of the
calls then add up to the aggregate of the whole step's batch: micro-batches and ranks of different
sizes weigh what their tokens or sequences weigh. ``denom=None`` (the default) is the call's own count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as tdist
from torch import Tensor

from fleetrl.common.plugins.registry import Registry

Aggregation = Callable[[Tensor, Tensor, "int | None", "float | None"], Tensor]
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation", config_key="algorithm.loss_agg")


def _as_denom(denom: float, like: Tensor) -> Tensor:
    """``denom`` (at least 1) as a 0-d tensor of ``like``'s dtype and device: a true division, as by a count."""
    return torch.as_tensor(denom, dtype=like.dtype, device=like.device).clamp_min(1)


def _valid_seq_mean(per_seq_B: Tensor, m_BT: Tensor, denom: float | None) -> Tensor:
    """Mean of ``per_seq_B`` over the sequences with at least one valid token (0 when there are none);
    with ``denom``, their sum over ``denom`` (the global sequence count)."""
    has_tokens_B = (m_BT.sum(-1) > 0).to(per_seq_B.dtype)
    total = (per_seq_B * has_tokens_B).sum()
    return total / (has_tokens_B.sum().clamp_min(1) if denom is None else _as_denom(denom, total))


@AGGREGATIONS.register("token-mean")
def token_mean(loss_BT: Tensor, m_BT: Tensor, norm_len: int | None = None, denom: float | None = None) -> Tensor:
    """sum_{i,t} m_it l_it / sum_{i,t} m_it: every valid token weighs the same."""
    total = (loss_BT * m_BT).sum()
    return total / (m_BT.sum().clamp_min(1) if denom is None else _as_denom(denom, total))


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_BT: Tensor, m_BT: Tensor, norm_len: int | None = None, denom: float | None = None
) -> Tensor:
    """mean_i sum_t m_it l_it: longer sequences weigh more (grows with length)."""
    return _valid_seq_mean((loss_BT * m_BT).sum(-1), m_BT, denom)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_BT: Tensor, m_BT: Tensor, norm_len: int | None = None, denom: float | None = None
) -> Tensor:
    """mean_i (sum_t m_it l_it / |y_i|): every sequence weighs the same, whatever its length."""
    per_seq_B = (loss_BT * m_BT).sum(-1) / m_BT.sum(-1).clamp_min(1)
    return _valid_seq_mean(per_seq_B, m_BT, denom)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_BT: Tensor, m_BT: Tensor, norm_len: int | None = None, denom: float | None = None
) -> Tensor:
    """mean_i (sum_t m_it l_it / L) with a fixed L: every token weighs the same in every batch and the
    value does not grow with batch size or response length (Dr. GRPO's length-unbiased form)."""
    if norm_len is None:
        raise ValueError(
            "loss_agg seq-mean-token-sum-norm needs a fixed length: set algorithm.loss_agg_norm_len "
            "(the learner fills it with rollout.max_new_tokens when it is null)"
        )
    return _valid_seq_mean((loss_BT * m_BT).sum(-1) / norm_len, m_BT, denom)


def aggregate(
    loss_BT: Tensor, mask_BT: Tensor, mode: str, norm_len: int | None = None, denom: float | None = None
) -> Tensor:
    """Aggregate per-token losses ``loss_BT`` ``[B, T]`` under ``mask_BT`` ``[B, T]`` into a scalar.

    ``mode`` is one of ``AGGREGATIONS`` (an unknown one raises listing the valid names); ``norm_len``
    is the fixed L of ``seq-mean-token-sum-norm`` and ignored by the other modes; ``denom`` is the global
    token or sequence count to divide by (see the module docstring; ``global_counts`` gives it), None
    for this call's own. Masked positions are
    selected away (not multiplied by 0), so inf or NaN in padding reaches neither the value nor the
    gradient.
    """
    m_BT = mask_BT.to(loss_BT.dtype)
    return AGGREGATIONS[mode](torch.where(m_BT > 0, loss_BT, 0.0), m_BT, norm_len, denom)


def counts(mask_BT: Tensor) -> Tensor:
    """``[2]`` float64: (valid tokens, valid sequences) of ``mask_BT``, the two denominators of ``aggregate``."""
    m_BT = mask_BT > 0
    return torch.stack([m_BT.sum(), m_BT.any(-1).sum()]).double()


def per_token(mode: str) -> bool:
    """True when ``mode`` divides by tokens (``token-mean``), False when by sequences (``seq-mean-*``)."""
    return AGGREGATIONS[mode] is token_mean  # an unknown mode raises, naming the valid ones


def global_counts(masks: list[Tensor], device: torch.device) -> tuple[list[Tensor], Tensor]:
    """Each mask's (tokens, sequences) counts and their sum over ``masks`` and over every rank: one
    all-reduce (when torch.distributed runs with more than one rank), so call it on every rank, with
    this rank's micro-batches of one optimizer step. Returns ``(per mask [2] tensors, global [2])``."""
    local = [counts(m) for m in masks]
    total = torch.stack(local).sum(0) if local else torch.zeros(2, dtype=torch.float64)
    total = total.to(device)
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(total)
    return local, total
