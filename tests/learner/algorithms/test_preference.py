"""Preference losses (DPO sigmoid with label smoothing, IPO)."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.config.algorithm import DpoAlgorithm
from fleetrl.learner.algorithms import PREFERENCE_LOSSES, PreferenceInputs


def _pair(chosen, rejected, ref_chosen, ref_rejected, dtype=torch.float32):
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    return PreferenceInputs(t(chosen), t(rejected), t(ref_chosen), t(ref_rejected))


def test_sigmoid_hand_computed():
    cfg = DpoAlgorithm(beta=0.1)
    out = PREFERENCE_LOSSES["sigmoid"](_pair([-1.0], [-3.0], [-2.0], [-2.0]), cfg)
    # h = (-1 + 2) - (-3 + 2) = 2; beta h = 0.2; loss = -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.2)), abs=1e-6)
    # implicit rewards: 0.1 * (-1 + 2) = 0.1 and 0.1 * (-3 + 2) = -0.1; margin 0.2; accuracy 1
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.1]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.1]))
    assert out.metrics["dpo/accuracy"] == 1.0
    assert out.metrics["dpo/margin"] == pytest.approx(0.2)


def test_sigmoid_label_smoothing_hand_computed():
    cfg = DpoAlgorithm(beta=0.1, label_smoothing=0.1)
    out = PREFERENCE_LOSSES["sigmoid"](_pair([-1.0], [-3.0], [-2.0], [-2.0]), cfg)
    # 0.9 * -log sigmoid(0.2) + 0.1 * -log sigmoid(-0.2) = 0.9 * 0.598139 + 0.1 * 0.798139 = 0.618139
    expected = 0.9 * math.log1p(math.exp(-0.2)) + 0.1 * math.log1p(math.exp(0.2))
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_ipo_hand_computed():
    out = PREFERENCE_LOSSES["ipo"](_pair([-1.0, -2.0], [-3.0, -2.0], [-2.0, -2.0], [-2.0, -2.0]), DpoAlgorithm())
    # beta 0.1 -> target margin 1 / (2 * 0.1) = 5;  h = [2, 0];  loss = mean((2 - 5)^2, (0 - 5)^2) = (9 + 25) / 2 = 17
    assert out.loss.item() == pytest.approx(17.0)
    # pair 1 has equal rewards (0 vs 0): not counted as correct -> accuracy 1/2
    assert out.metrics["dpo/accuracy"] == 0.5


@pytest.mark.parametrize("name", ["sigmoid", "ipo"])
def test_huge_margins_stay_finite(name):
    inp = _pair([1e4, -1e4], [-1e4, 1e4], [0.0, 0.0], [0.0, 0.0])
    inp.chosen_logp.requires_grad_(True)
    out = PREFERENCE_LOSSES[name](inp, DpoAlgorithm())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(inp.chosen_logp.grad).all()
    assert set(out.metrics) == {"dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/rewards_chosen", "dpo/rewards_rejected"}


def test_gradcheck_sigmoid():
    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(5, dtype=torch.float64, generator=g) * 3).requires_grad_(True) for _ in range(4)]
    cfg = DpoAlgorithm(beta=0.5, label_smoothing=0.1)
    fn = lambda *xs: PREFERENCE_LOSSES["sigmoid"](PreferenceInputs(*xs), cfg).loss  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(tensors))
