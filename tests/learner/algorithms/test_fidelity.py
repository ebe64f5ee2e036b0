"""Issue 29 (algorithm fidelity): ReMax reward-to-go, sequence-level batch normalisation, k2+; hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.config.algorithm import OffPolicyConfig, RlAlgorithm
from fleetrl.learner.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS
from fleetrl.learner.algorithms.kl import apply_kl_penalty
from fleetrl.learner.algorithms.off_policy import behaviour_weights


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=1e-12, rtol=0)


def test_remax_uses_the_reward_to_go_of_a_dense_reward():
    # row 0: r = [0.1, -0.2, 1.0], G = [0.9, 0.8, 1.0]; baseline 0.5 -> A = [0.4, 0.3, 0.5]
    # row 1: interior mask, r = [0.3, (masked 9), 0.2]: G = [0.5, 0, 0.2]; baseline 0 -> A = G
    r = torch.tensor([[0.1, -0.2, 1.0], [0.3, 9.0, 0.2]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    adv, returns = ADV_ESTIMATORS["remax"](
        r, m, torch.tensor([0, 1]), None, RlAlgorithm(), baselines_B=torch.tensor([0.5, 0.0], dtype=torch.float64)
    )
    _close(returns, [[0.9, 0.8, 1.0], [0.5, 0.0, 0.2]])
    _close(adv, [[0.4, 0.3, 0.5], [0.5, 0.0, 0.2]])


def test_remax_with_a_per_token_kl_penalty_differs_per_token():
    # kl.placement: reward. Outcome 1 on the last token, kl_t = [0.2, 0.4, 0.1], coef 0.5:
    # r = [-0.1, -0.2, 1 - 0.05] = [-0.1, -0.2, 0.95]; G = [0.65, 0.75, 0.95]; baseline 0.5 -> A = [0.15, 0.25, 0.45]
    # (the old whole-sequence form gave 0.15 on every token)
    outcome = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.float64)
    kl = torch.tensor([[0.2, 0.4, 0.1]], dtype=torch.float64)
    r = apply_kl_penalty(outcome, kl, m, coef=0.5)
    _close(r, [[-0.1, -0.2, 0.95]])
    adv, _ = ADV_ESTIMATORS["remax"](
        r, m, torch.tensor([0]), None, RlAlgorithm(), baselines_B=torch.tensor([0.5], dtype=torch.float64)
    )
    _close(adv, [[0.15, 0.25, 0.45]])


def test_remax_with_a_discount_follows_gamma():
    # gamma 0.5, r = [1, 0, 2]: G = [1 + 0.5 * (0 + 0.5 * 2), 0.5 * 2, 2] = [1.5, 1.0, 2.0]; baseline 1
    r = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.float64)
    adv, _ = ADV_ESTIMATORS["remax"](
        r, m, torch.tensor([0]), None, RlAlgorithm(gamma=0.5), baselines_B=torch.tensor([1.0], dtype=torch.float64)
    )
    _close(adv, [[0.5, 0.0, 1.0]])


def test_sequence_level_batch_normalise_divides_by_the_mean_over_non_empty_sequences():
    # log rho_i = sum_t (old - mu): sequence 0 (3 tokens) ln 2 -> w 2; sequence 1 (1 token) 0 -> w 1;
    # sequence 2 is empty. Mean over non-empty sequences = (2 + 1) / 2 = 1.5 (the token mean would be
    # (3 * 2 + 1) / 4 = 1.75): weights 4/3 and 2/3.
    d = math.log(2.0) / 3
    old = torch.tensor([[d, d, d], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mu = torch.zeros(3, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    cfg = OffPolicyConfig(mode="tis", level="sequence", cap=3.0, batch_normalize=True)
    w = behaviour_weights(old, mu, mask, cfg).weight
    assert w[0].tolist() == pytest.approx([4 / 3] * 3)
    assert w[1, 0].item() == pytest.approx(2 / 3)
    # token level is unchanged: the same sequences' token weights divided by their token mean, 1.75
    wt = behaviour_weights(
        old, mu, mask, OffPolicyConfig(mode="tis", level="sequence", cap=3.0, batch_normalize=True), level="token"
    ).weight
    tok = behaviour_weights(old, mu, mask, OffPolicyConfig(mode="tis", level="token", cap=3.0)).weight
    valid = mask > 0
    assert wt[valid].tolist() == pytest.approx((tok[valid] / tok[valid].mean()).tolist())


def test_k2_plus_is_k2_in_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    plus = KL_ESTIMATORS["k2+"](logp, ref)
    # 1/2 (log r)^2 = [0.125, 0.5]; d/dlogp = log pi - log pi_ref = [0.5, -1.0]
    _close(plus, [[0.125, 0.5]])
    (g,) = torch.autograd.grad(plus.sum(), logp)
    _close(g, [[0.5, -1.0]])
    assert load_config(None, ["algorithm.kl.estimator=k2+"]).algorithm.kl.estimator == "k2+"
    with pytest.raises(ConfigError, match="algorithm.kl.estimator"):
        load_config(None, ["algorithm.kl.estimator=k2++"])
