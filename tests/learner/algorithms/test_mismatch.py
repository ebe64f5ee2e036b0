"""Engine mismatch against policy drift: ``mismatch_sums`` counts only the tokens the trained version sampled."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.learner.algorithms.off_policy import mismatch_sums


def k3(behav: float, learner: float) -> float:
    """KL(mu || pi) per token with r = pi / mu: (r - 1) - log r."""
    log_r = learner - behav
    return math.expm1(log_r) - log_r


def test_only_samples_the_trained_version_sampled_from_start_to_end_count():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    behav = torch.tensor([[-1.5, -2.0, -0.1, -9.0], [-5.0, -5.0, -5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # row 0: tokens 2-3 are an observation (mask 0, no version of ours) and padding; row 1 spans an in-flight
    # update (6 -> 7): its version-7 tokens attend to version 6's keys and values, so none of it counts
    versions = torch.tensor([[7, 7, -1, -1], [6, 6, 7, 7]])
    kl_sum, n = mismatch_sums(old, behav, mask, versions, version=7)
    # row 0 token 0: log r = -1 - (-1.5) = 0.5 -> e^0.5 - 1 - 0.5 = 0.148721; token 1: log r = 0 -> 0
    assert n.item() == 2
    assert kl_sum.item() == pytest.approx(k3(-1.5, -1.0) + 0.0, rel=1e-6)


def test_no_token_of_the_trained_version_gives_zero_count():
    old = torch.zeros(2, 3)
    kl_sum, n = mismatch_sums(old, old - 1.0, torch.ones(2, 3), torch.full((2, 3), 4), version=5)
    assert n.item() == 0 and kl_sum.item() == 0.0


def test_identical_numerics_measure_zero():
    logp = torch.log_softmax(torch.randn(3, 5, 11), -1)[..., 0]
    kl_sum, n = mismatch_sums(logp, logp.clone(), torch.ones(3, 5), torch.zeros(3, 5, dtype=torch.int64), version=0)
    assert n.item() == 15 and kl_sum.item() == 0.0
