"""Entropy from logits, the clipped value loss, masked whitening and group statistics."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.learner.algorithms import entropy_from_logits, group_stats, masked_whiten, value_loss


def test_entropy_hand_computed():
    # uniform over 4 -> log 4 = 1.386294;  two equal logits and two -inf -> log 2 = 0.693147
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -math.inf, -math.inf]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), math.log(2)]))


def test_entropy_matches_torch_distributions():
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)


def test_entropy_with_neg_inf_logits_has_finite_gradient():
    logits = torch.tensor([[1.0, -math.inf, 0.5, -math.inf]], requires_grad=True)
    h = entropy_from_logits(logits)
    h.sum().backward()
    assert torch.isfinite(h).all() and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1] == 0 and logits.grad[0, 3] == 0


def test_entropy_is_stable_for_huge_logits():
    h = entropy_from_logits(torch.tensor([[1000.0, 0.0, -1000.0]]))
    assert h.item() == pytest.approx(0.0, abs=1e-6)


def test_gradcheck_entropy():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


def test_value_loss_hand_computed():
    values = torch.tensor([[1.5, 1.1]], requires_grad=True)
    old, returns = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]])
    out = value_loss(values, old, returns, torch.ones(1, 2), clip_range=0.2)
    # token 0: unclipped (1.5 - 2)^2 = 0.25; V_clip = 1 + clip(0.5) = 1.2, (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64 = 0.32
    # token 1: V = 1.1 is inside the clip: (1.1 - 0)^2 = 1.21 -> 0.605
    # token-mean: (0.32 + 0.605) / 2 = 0.4625; clipped term active on token 0 only
    assert out.loss.item() == pytest.approx(0.4625)
    assert out.metrics["critic/clipfrac"] == pytest.approx(0.5)
    out.loss.backward()
    # token 0 takes the clipped branch (no gradient); token 1: d/dV 0.5 (V - R)^2 / 2 = 1.1 / 2 = 0.55
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.55]]))


def test_gradcheck_value_loss():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, dtype=torch.float64, generator=g).requires_grad_(True)
    old = torch.randn(3, 4, dtype=torch.float64, generator=g)
    returns = torch.randn(3, 4, dtype=torch.float64, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.3
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old, returns, mask, 0.2).loss, (values,))


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = masked_whiten(x, mask)
    # valid values 1, 2, 3: mean 2, unbiased var 1 -> [-1, 0, 1]; masked positions 0
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    assert torch.equal(masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))
    single = torch.zeros_like(mask)
    single[0, 0] = True
    assert torch.equal(masked_whiten(x, single), torch.zeros_like(x))


def test_group_stats_with_arbitrary_ids():
    x = torch.tensor([1.0, 3.0, 5.0, 2.0, 2.0])
    stats = group_stats(x, torch.tensor([70, 70, -3, 1000, 1000]))
    torch.testing.assert_close(stats.count, torch.tensor([2.0, 2.0, 1.0, 2.0, 2.0]))
    torch.testing.assert_close(stats.mean, torch.tensor([2.0, 2.0, 5.0, 2.0, 2.0]))
    # group 70: deviations +-1, unbiased var = 2 / 1 -> std sqrt(2)
    torch.testing.assert_close(stats.std, torch.tensor([math.sqrt(2), math.sqrt(2), 0.0, 0.0, 0.0]))
    assert stats.no_signal.tolist() == [False, False, True, True, True]
