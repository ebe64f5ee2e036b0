"""Estimators, KL forms, DPO losses and IS weights added for algorithm breadth: hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.config.algorithm import DpoAlgorithm, OffPolicyConfig, RlAlgorithm
from fleetrl.learner.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, PREFERENCE_LOSSES, PreferenceInputs
from fleetrl.learner.algorithms.off_policy import behaviour_weights


def _outcome(rewards, lengths, T=3, dtype=torch.float32):
    r = torch.zeros(len(rewards), T, dtype=dtype)
    m = torch.zeros(len(rewards), T, dtype=dtype)
    for i, (x, n) in enumerate(zip(rewards, lengths)):
        m[i, :n] = 1
        r[i, n - 1] = x
    return r, m


def test_grpo_std_eps_is_configurable():
    # rewards 1, 0 in one group: mean 0.5, unbiased std sqrt(0.5) = 0.70711; eps 0.5 -> 0.5 / 1.20711 = 0.41421
    r, m = _outcome([1.0, 0.0], [2, 2])
    adv, _ = ADV_ESTIMATORS["grpo"](r, m, torch.tensor([0, 0]), None, RlAlgorithm(std_eps=0.5))
    assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5))
    assert adv[1, 1].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 0.5))


def test_grpo_var_floor_floors_the_group_variance():
    # rewards 1.001, 1.000: var = 5e-7 (unbiased), floor 1e-4 -> std 0.01; A = +-0.0005 / (0.01 + 1e-6)
    r, m = _outcome([1.001, 1.000], [1, 1], dtype=torch.float64)
    cfg = RlAlgorithm(var_floor=1e-4, std_eps=1e-6)
    adv, _ = ADV_ESTIMATORS["grpo_var_floor"](r, m, torch.tensor([0, 0]), None, cfg)
    assert adv[0, 0].item() == pytest.approx(0.0005 / (0.01 + 1e-6), rel=1e-6)
    plain, _ = ADV_ESTIMATORS["grpo"](r, m, torch.tensor([0, 0]), None, cfg)
    assert plain[0, 0].item() == pytest.approx(0.0005 / (math.sqrt(5e-7) + 1e-6), rel=1e-6)  # ~0.707: +-1 / sqrt 2


def test_grpo_var_floor_above_the_floor_equals_grpo():
    r, m = _outcome([3.0, 0.0, 1.0], [2, 1, 3])
    g = torch.tensor([0, 0, 0])
    a, _ = ADV_ESTIMATORS["grpo_var_floor"](r, m, g, None, RlAlgorithm())
    b, _ = ADV_ESTIMATORS["grpo"](r, m, g, None, RlAlgorithm())
    assert torch.allclose(a, b)


def test_remax_subtracts_the_greedy_reward():
    # rewards 1, 0, 0.5 with greedy baselines 0.5 (group 0) and 1.0 (group 1): A = 0.5, -0.5, -0.5
    r, m = _outcome([1.0, 0.0, 0.5], [2, 3, 1])
    adv, returns = ADV_ESTIMATORS["remax"](
        r, m, torch.tensor([0, 0, 1]), None, RlAlgorithm(), baselines_B=torch.tensor([0.5, 0.5, 1.0])
    )
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [-0.5, 0.0, 0.0]]
    assert returns.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]  # reward-to-go G_t
    with pytest.raises(ValueError, match="greedy"):
        ADV_ESTIMATORS["remax"](r, m, torch.tensor([0, 0, 1]), None, RlAlgorithm())


def test_abs_kl_and_straight_through_forms():
    logp = torch.tensor([-1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -1.0])
    # abs: |1|, |-2| -> 1, 2
    assert KL_ESTIMATORS["abs"](logp, ref).tolist() == [1.0, 2.0]
    # k3+: the value of k3 (log r = -1: e^-1 + 1 - 1 = 0.36788; log r = 2: e^2 - 3 = 4.38906) ...
    st = KL_ESTIMATORS["k3+"](logp, ref)
    assert st.tolist() == pytest.approx([math.exp(-1), math.exp(2) - 3], rel=1e-6)
    # ... and the gradient of k2 = 1/2 (logp - ref)^2: d/dlogp = logp - ref = 1, -2
    st.sum().backward()
    assert logp.grad.tolist() == [1.0, -2.0]
    for name in ("k1+", "abs+"):
        logp.grad = None
        value = KL_ESTIMATORS[name](logp, ref)
        assert value.tolist() == KL_ESTIMATORS[name[:-1]](logp, ref).tolist()
        value.sum().backward()
        assert logp.grad.tolist() == [1.0, -2.0]


def _pair(pc, pr, rc=0.0, rr=0.0, lc=None, lr=None):
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    return PreferenceInputs(t(pc), t(pr), t(rc), t(rr), None if lc is None else t(lc), None if lr is None else t(lr))


def test_hinge_loss():
    # h = (-1 - -2) - (-3 - -2) = 2; beta 0.1: max(0, 1 - 0.2) = 0.8;  beta 1: max(0, 1 - 2) = 0
    inp = _pair(-1.0, -3.0, -2.0, -2.0)
    assert PREFERENCE_LOSSES["hinge"](inp, DpoAlgorithm(beta=0.1)).loss.item() == pytest.approx(0.8)
    assert PREFERENCE_LOSSES["hinge"](inp, DpoAlgorithm(beta=1.0)).loss.item() == 0.0


def test_robust_dpo():
    # h = 2, beta 0.5 -> z = 1; eps 0.1: (0.9 * softplus(-1) - 0.1 * softplus(1)) / 0.8
    inp = _pair(-1.0, -3.0, -2.0, -2.0)
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731  (-log sigmoid(z) = softplus(-z))
    want = (0.9 * sp(-1.0) - 0.1 * sp(1.0)) / 0.8
    assert PREFERENCE_LOSSES["robust"](inp, DpoAlgorithm(beta=0.5, label_smoothing=0.1)).loss.item() == pytest.approx(
        want
    )
    dpo = PREFERENCE_LOSSES["sigmoid"](inp, DpoAlgorithm(beta=0.5)).loss.item()
    assert PREFERENCE_LOSSES["robust"](inp, DpoAlgorithm(beta=0.5)).loss.item() == pytest.approx(dpo)  # eps 0 = DPO


def test_length_normalised_ipo():
    # chosen: (-4 - -6) / 4 tokens = 0.5; rejected: (-9 - -8) / 2 tokens = -0.5; h_norm = 1
    # tau 0.25 -> target 1 / 0.5 = 2: (1 - 2)^2 = 1
    inp = _pair(-4.0, -9.0, -6.0, -8.0, lc=4.0, lr=2.0)
    assert PREFERENCE_LOSSES["ipo_norm"](inp, DpoAlgorithm(beta=0.25)).loss.item() == pytest.approx(1.0)
    # plain IPO on the sums: h = 2 - (-1) = 3 -> (3 - 2)^2 = 1 as well; change the lengths and only ipo_norm moves
    longer = _pair(-4.0, -9.0, -6.0, -8.0, lc=8.0, lr=2.0)  # 0.25 + 0.5 = 0.75 -> (0.75 - 2)^2 = 1.5625
    assert PREFERENCE_LOSSES["ipo_norm"](longer, DpoAlgorithm(beta=0.25)).loss.item() == pytest.approx(1.5625)
    with pytest.raises(ValueError, match="lengths"):
        PREFERENCE_LOSSES["ipo_norm"](_pair(-4.0, -9.0), DpoAlgorithm())


def test_reference_free_dpo_is_dpo_with_zero_reference():
    # reference-free: h = log pi(y_w) - log pi(y_l) = -1 - -3 = 2; beta 0.1: -log sigmoid(0.2) = 0.59814
    out = PREFERENCE_LOSSES["sigmoid"](_pair(-1.0, -3.0), DpoAlgorithm(beta=0.1, reference_free=True))
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.2)))
    assert not DpoAlgorithm(reference_free=True).needs_reference and DpoAlgorithm().needs_reference


def test_batch_normalised_is_weights_average_one():
    # log rho per token = old - mu = [0, ln 2, ln 4] (4 capped at C = 3 under tis -> 3): weights 1, 2, 3 -> mean 2
    old = torch.tensor([[0.0, math.log(2.0), math.log(4.0), 5.0]])
    mu = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    plain = behaviour_weights(old, mu, mask, OffPolicyConfig(mode="tis", cap=3.0)).weight
    normed = behaviour_weights(old, mu, mask, OffPolicyConfig(mode="tis", cap=3.0, batch_normalize=True)).weight
    assert plain[0, :3].tolist() == pytest.approx([1.0, 2.0, 3.0])
    assert normed[0, :3].tolist() == pytest.approx([0.5, 1.0, 1.5])  # divided by the valid tokens' mean, 2
