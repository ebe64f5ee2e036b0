"""DAPO's data-side pieces (Yu et al. 2025, "DAPO", arXiv 2503.14476): dynamic sampling and overlong
reward shaping. Its clip-higher loss is ``POLICY_LOSSES["dapo"]`` and its token-level aggregation
is ``loss_agg: token-mean``.

Shape legend: N samples (sequences), B sequences of a batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fleetrl.learner.algorithms.common import group_stats


def dynamic_sampling_filter(rewards_N: Tensor, group_index_N: Tensor) -> tuple[Tensor, int]:
    """DAPO dynamic sampling (section "Dynamic Sampling"): keep only groups whose rewards differ.

    A group whose rewards are all equal (all correct, all wrong, or a group of one) has zero
    advantage under every group estimator and only dilutes the batch, so it is dropped whole.

    Args:
        rewards_N: ``[N]`` scalar reward of each sample.
        group_index_N: ``[N]`` group id of each sample (same id = same prompt).

    Returns:
        keep_N: ``[N]`` bool, the same value for every member of a group.
        n_dropped: number of groups dropped.
    """
    no_signal_N = group_stats(rewards_N.detach(), group_index_N).no_signal
    n_dropped = torch.unique(group_index_N[no_signal_N]).numel()
    return ~no_signal_N, n_dropped


def overlong_penalty(lengths_B: Tensor, max_len: int, buffer_len: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (section "Overlong Reward Shaping"), scaled by ``penalty``, ``[B]``, always <= 0:

        R_len(y) = 0                                   if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                  if |y| > L_max

    Args:
        lengths_B: ``[B]`` response lengths |y| in tokens (int, or float to differentiate through).
        max_len: L_max, the generation limit (``rollout.max_new_tokens``).
        buffer_len: L_cache, the penalty zone before it (``algorithm.overlong.buffer_len``).
        penalty: the penalty at |y| >= L_max (``algorithm.overlong.penalty``).

    Add the result to each sample's reward before advantages.
    """
    over_B = (lengths_B - (max_len - buffer_len)) / buffer_len
    return -penalty * over_B.clamp(0.0, 1.0)
