"""Advantage estimators: token rewards -> (advantages, returns), looked up by ``algorithm.adv_estimator``.

Shape legend: B sequences, T padded response positions.

Every estimator has one signature::

    adv_BT, returns_BT = ADV_ESTIMATORS[name](token_rewards_BT, mask_BT, group_index_B, values_BT, cfg,
                                              baselines_B=None)

- ``token_rewards_BT`` ``[B, T]``: reward of each response token (the outcome reward on the last
  token, minus a per-token KL penalty when ``kl.placement: reward``).
- ``mask_BT`` ``[B, T]`` bool or 0/1: valid response tokens.
- ``group_index_B`` ``[B]`` integer ids: samples with the same id answer the same prompt.
- ``values_BT`` ``[B, T]`` critic values, needed by ``gae`` only (``None`` elsewhere).
- ``cfg``: the ``RlAlgorithm``.
- ``baselines_B`` ``[B]`` a per-sample baseline reward, needed by ``remax`` only: the reward of the
  policy's greedy response to the same prompt, which the rollout server scores with the group.

Both outputs are ``[B, T]`` and exactly zero where masked. Outcome estimators (``grpo``, ``drgrpo``,
``rloo``, ``reinforce_pp_baseline``) score sequence i with R_i = sum_t mask_it * r_it and broadcast
its advantage to every valid token; their ``returns`` equal the advantages (nothing regresses on them).
Call them under ``torch.no_grad()``: the outputs are data for the loss.

Edge cases (every group estimator): a group of one has no baseline -> advantage 0; a group whose
rewards are all equal -> exactly 0 (decided by max == min, not by a small std); an empty response row
-> zeros. ``reinforce_pp_baseline`` applies the batch whitening of its paper after that, so those
zeros move with the batch mean like every other token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.common.plugins.registry import Registry
from fleetrl.learner.algorithms.common import group_stats, masked_whiten

AdvEstimator = Callable[..., "tuple[Tensor, Tensor]"]
ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("advantage estimator", config_key="algorithm.adv_estimator")


def _sequence_rewards(token_rewards_BT: Tensor, m_BT: Tensor) -> Tensor:
    """R_i = sum_t m_it r_it, ``[B]``."""
    return torch.where(m_BT > 0, token_rewards_BT, 0.0).sum(-1)


def _broadcast(adv_B: Tensor, m_BT: Tensor) -> tuple[Tensor, Tensor]:
    adv_BT = torch.where(m_BT > 0, adv_B[:, None], 0.0)
    return adv_BT, adv_BT


def _group_centred(
    token_rewards_BT: Tensor,
    mask_BT: Tensor,
    group_index_B: Tensor,
    norm_by_std: bool,
    std_eps: float = 0.0,
    var_floor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(R_i - mean_g) [/ (std_g + eps)] per sequence, 0 for groups without signal; also returns the mask.

    ``var_floor``: the std is sqrt(max(var_g, var_floor)) (verl's vectorised GRPO)."""
    m_BT = mask_BT.to(token_rewards_BT.dtype)
    r_B = _sequence_rewards(token_rewards_BT, m_BT)
    g = group_stats(r_B, group_index_B)
    centred_B = r_B - g.mean
    if norm_by_std:
        std_B = g.std if var_floor is None else g.std.square().clamp_min(var_floor).sqrt()
        centred_B = centred_B / (std_B + std_eps)
    return torch.where(g.no_signal, 0.0, centred_B), m_BT


@ADV_ESTIMATORS.register("grpo")
def grpo(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, GRPO outcome supervision):

        A_i = (R_i - mean_g R) / (std_g R + eps)      (unbiased std; no division if not norm_by_std)

    Config: ``norm_by_std`` (default true), ``std_eps`` (eps, default 1e-6). Groups of one and
    all-equal groups give 0.
    """
    adv_B, m_BT = _group_centred(token_rewards_BT, mask_BT, group_index_B, cfg.norm_by_std, cfg.std_eps)
    return _broadcast(adv_B, m_BT)


@ADV_ESTIMATORS.register("grpo_var_floor")
def grpo_var_floor(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """GRPO with the group variance floored, as verl's vectorised GRPO computes it (``group_mean_std``):

        A_i = (R_i - mean_g R) / (sqrt(max(var_g R, floor)) + eps)

    A group whose rewards barely differ (var_g << floor) then gets small advantages instead of +-1
    from dividing tiny differences by a tiny std. Config: ``var_floor`` (1e-6), ``std_eps`` (1e-6),
    ``norm_by_std``. Groups of one and all-equal groups give 0 (verl gives a singleton its raw reward).
    """
    adv_B, m_BT = _group_centred(
        token_rewards_BT, mask_BT, group_index_B, cfg.norm_by_std, cfg.std_eps, var_floor=cfg.var_floor
    )
    return _broadcast(adv_B, m_BT)


@ADV_ESTIMATORS.register("remax")
def remax(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models", arXiv 2310.10505, Algorithm 1): REINFORCE with the reward of
    the greedy response as baseline, in the causal (reward-to-go) form:

        A_it = G_it - R(greedy response to the same prompt),    G_it = sum_{k >= t} gamma^(k-t) r_ik

    the same return as ``reinforce_pp`` (``gamma``, default 1.0; verl's ``remax`` is gamma = 1). With
    the reward on the last token only, G_it = R_i on every valid token. ``baselines_B`` holds the
    greedy reward per sample (the rollout server scores a greedy response with each group when
    ``adv_estimator: remax``). Returns are the G_it.
    """
    if baselines_B is None:
        raise ValueError(
            "adv_estimator remax needs each group's greedy-response reward (baselines_B); the rollout "
            "server sends it when algorithm.adv_estimator=remax"
        )
    m_BT = mask_BT.to(token_rewards_BT.dtype)
    returns_BT = discounted_returns(token_rewards_BT, mask_BT, cfg.gamma)
    adv_BT = torch.where(m_BT > 0, returns_BT - baselines_B.to(token_rewards_BT.dtype)[:, None], 0.0)
    return adv_BT, returns_BT


@ADV_ESTIMATORS.register("drgrpo")
def drgrpo(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783,
    Dr. GRPO): A_i = R_i - mean_g R, no std division (which biases towards too easy / too hard
    prompts). Pair it with ``loss_agg: seq-mean-token-sum-norm`` to remove the length bias as well.
    """
    adv_B, m_BT = _group_centred(token_rewards_BT, mask_BT, group_index_B, norm_by_std=False)
    return _broadcast(adv_B, m_BT)


@ADV_ESTIMATORS.register("rloo")
def rloo(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free";
    Ahmadian et al. 2024, arXiv 2402.14740, RLOO):

        A_i = R_i - 1/(n-1) sum_{j != i} R_j  =  n/(n-1) * (R_i - mean_g R)

    Groups of one (no other sample to compare with) and all-equal groups give 0.
    """
    m_BT = mask_BT.to(token_rewards_BT.dtype)
    r_B = _sequence_rewards(token_rewards_BT, m_BT)
    g = group_stats(r_B, group_index_B)
    adv_B = g.count / (g.count - 1).clamp_min(1) * (r_B - g.mean)
    return _broadcast(torch.where(g.no_signal, 0.0, adv_B), m_BT)


def discounted_returns(token_rewards_BT: Tensor, mask_BT: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t'} over valid tokens (t' = next valid token), ``[B, T]``, 0 where masked.

    Masked positions neither add reward nor discount: the running return passes through them, so
    interior masks (e.g. tool output in a multi-turn response) do not cut the sequence.
    """
    m_BT = mask_BT.to(token_rewards_BT.dtype)
    running_B = token_rewards_BT.new_zeros(token_rewards_BT.shape[0])
    returns = []
    for t in reversed(range(token_rewards_BT.shape[1])):
        running_B = torch.where(m_BT[:, t] > 0, token_rewards_BT[:, t] + gamma * running_B, running_B)
        returns.append(running_B * m_BT[:, t])
    return torch.stack(returns[::-1], dim=1)


@ADV_ESTIMATORS.register("reinforce_pp")
def reinforce_pp(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): per-token discounted return with the per-token
    KL penalty folded into the rewards, whitened over all valid tokens of the batch:

        G_t = sum_{k >= t} gamma^(k-t) r_k,    A_t = (G_t - mean_batch G) / sqrt(var_batch G + 1e-8)

    Config: ``gamma`` (default 1.0). Returns are the unwhitened G_t.
    """
    returns_BT = discounted_returns(token_rewards_BT, mask_BT, cfg.gamma)
    return masked_whiten(returns_BT, mask_BT), returns_BT


@ADV_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262, later versions): subtract the group-mean reward,
    broadcast to tokens, then whiten over all valid tokens of the batch:

        A'_i = R_i - mean_g R,    A_it = (A'_i - mean_batch A') / sqrt(var_batch A' + 1e-8)

    Groups of one and all-equal groups get A' = 0 before the batch whitening.
    """
    adv_B, m_BT = _group_centred(token_rewards_BT, mask_BT, group_index_B, norm_by_std=False)
    adv_BT = masked_whiten(adv_B[:, None].expand_as(m_BT), m_BT)
    return adv_BT, adv_BT


@ADV_ESTIMATORS.register("gae")
def gae(token_rewards_BT, mask_BT, group_index_B, values_BT, cfg: RlAlgorithm, baselines_B=None):
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438, Eq. 16):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}          (V and A after the last token are 0)
        R_t     = A_t + V_t                                (the critic's targets)

    Masked positions are skipped (V and A carry through them). ``whiten_advantages`` whitens A over
    the batch's valid tokens; returns stay unwhitened. Config: ``gamma``, ``lam``, ``whiten_advantages``.
    ``values_BT`` ``[B, T]`` are the critic's predictions for the same tokens (detached).
    """
    if values_BT is None:
        raise ValueError(
            "adv_estimator gae needs critic values; configure algorithm.critic or pick an outcome "
            "estimator (grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline)"
        )
    m_BT = mask_BT.to(token_rewards_BT.dtype)
    next_value_B = values_BT.new_zeros(values_BT.shape[0])
    next_adv_B = values_BT.new_zeros(values_BT.shape[0])
    advs = []
    for t in reversed(range(token_rewards_BT.shape[1])):
        valid_B = m_BT[:, t] > 0
        delta_B = token_rewards_BT[:, t] + cfg.gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + cfg.gamma * cfg.lam * next_adv_B
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
        advs.append(torch.where(valid_B, adv_B, 0.0))
    adv_BT = torch.stack(advs[::-1], dim=1)
    returns_BT = torch.where(m_BT > 0, adv_BT + values_BT, 0.0)
    if cfg.whiten_advantages:
        adv_BT = masked_whiten(adv_BT, m_BT)
    return adv_BT, returns_BT
