"""KL estimators (Schulman's k1/k2/k3) and the KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.common.config.algorithm import AdaptiveKlConfig, KlConfig, RlAlgorithm
from fleetrl.learner.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_controller_from_config,
)


def test_hand_computed_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log pi - log pi_ref = log 2 = 0.693147
    assert KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(0.693147, abs=1e-6)
    # k2 = 1/2 (log 2)^2 = 0.5 * 0.480453 = 0.240227
    assert KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(0.240227, abs=1e-6)
    # k3: r = pi_ref / pi = 0.5; (r - 1) - log r = -0.5 + 0.693147 = 0.193147
    assert KL_ESTIMATORS["k3"](logp, ref).item() == pytest.approx(0.193147, abs=1e-6)


def test_all_zero_when_policies_agree():
    x = torch.randn(3, 4)
    for name in ("k1", "k2", "k3"):
        assert torch.equal(KL_ESTIMATORS[name](x, x), torch.zeros(3, 4))


def test_k1_and_k3_are_unbiased_monte_carlo():
    # Sample tokens from p; the sample means of k1 and k3 estimate KL(p || q).
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), -1)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    true_kl = (p * (p.log() - q.log())).sum().item()
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=g)
    logp, ref = p.log()[tokens], q.log()[tokens]
    for name in ("k1", "k3"):
        assert KL_ESTIMATORS[name](logp, ref).mean().item() == pytest.approx(true_kl, rel=0.02)
    # k3 has the lower variance (Schulman's point)
    assert KL_ESTIMATORS["k3"](logp, ref).var() < KL_ESTIMATORS["k1"](logp, ref).var()


@settings(max_examples=200, deadline=None)
@given(st.floats(-60, 60), st.floats(-60, 60))
def test_k2_and_k3_are_non_negative_and_finite(a, b):
    logp, ref = torch.tensor([a]), torch.tensor([b])
    for name in ("k2", "k3"):
        value = KL_ESTIMATORS[name](logp, ref)
        assert torch.isfinite(value).all() and value.item() >= 0.0


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_ratios_of_50_stay_finite_with_finite_gradients(name, dtype):
    logp = torch.tensor([[50.0, -50.0, 0.0]], dtype=dtype, requires_grad=True)
    value = KL_ESTIMATORS[name](logp, torch.zeros(1, 3, dtype=dtype))
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logp.grad).all()


def test_k3_is_exact_inside_its_bound_and_bounded_at_ten_outside():
    # log r = -2: e^-2 + 2 - 1 = 1.1353; log r = 2: e^2 - 2 - 1 = 4.3891 (both inside [0, 10])
    # log r = -19: e^-19 + 18 = 18 > 10 -> 10; log r = +20 (the reference far more likely than the
    # policy): e^20 - 21 ~ 4.85e8 unbounded, 10 bounded (verl's low_var_kl bound)
    logp = torch.tensor([2.0, -2.0, 19.0, -20.0, -50.0], dtype=torch.float64)
    value = KL_ESTIMATORS["k3"](logp, torch.zeros(5, dtype=torch.float64))
    assert value[0].item() == pytest.approx(math.exp(-2) + 2 - 1)
    assert value[1].item() == pytest.approx(math.exp(2) - 2 - 1)
    assert value[2:].tolist() == [10.0, 10.0, 10.0]


def test_one_far_off_token_cannot_blow_up_the_kl_loss_or_the_logged_kl():
    from fleetrl.learner.algorithms.kl import kl_loss

    logp = torch.tensor([[-1.0, -1.0, -1.0, -25.0]], requires_grad=True)  # last token: ref e^24 x more likely
    loss, kl = kl_loss(logp, torch.full((1, 4), -1.0), torch.ones(1, 4), "k3", "token-mean")
    assert loss.item() == pytest.approx(10.0 / 4)  # was (e^20 - 21) / 4 ~ 1.2e8 with only the log-ratio clamp
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_gradcheck_k3():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, dtype=torch.float64, generator=g).requires_grad_(True)
    ref = torch.randn(3, 4, dtype=torch.float64, generator=g).requires_grad_(True)
    assert torch.autograd.gradcheck(KL_ESTIMATORS["k3"], (logp, ref))


def test_apply_kl_penalty_only_on_valid_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    kl = torch.tensor([[0.5, 0.2, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # r - 0.1 * kl on valid tokens: [0 - 0.05, 1 - 0.02, 0 (masked)]
    out = apply_kl_penalty(rewards, kl, mask, coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.98, 0.0]]))
    assert not out.requires_grad


def test_fixed_controller_keeps_its_value():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=10.0, n_samples=1000)
    assert ctl.value == 0.05


def test_adaptive_controller_hand_computed():
    ctl = AdaptiveKLController(init_coef=0.1, target=0.01, horizon=1000)
    # KL 0.02: error = clip(0.02 / 0.01 - 1, -0.2, 0.2) = 0.2; beta *= 1 + 0.2 * 100 / 1000 = 1.02 -> 0.102
    ctl.update(current_kl=0.02, n_samples=100)
    assert ctl.value == pytest.approx(0.102)
    # KL 0.009: error = -0.1; beta *= 1 - 0.1 * 100 / 1000 = 0.99 -> 0.10098
    ctl.update(current_kl=0.009, n_samples=100)
    assert ctl.value == pytest.approx(0.10098)
    restored = AdaptiveKLController(init_coef=1.0, target=0.01, horizon=1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_controller_from_config():
    assert isinstance(kl_controller_from_config(KlConfig(coef=0.3)), FixedKLController)
    kl_cfg = KlConfig(coef=0.2, adaptive=AdaptiveKlConfig(target=0.05, horizon=50))
    adaptive = kl_controller_from_config(RlAlgorithm(kl=kl_cfg))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.05, 50)
