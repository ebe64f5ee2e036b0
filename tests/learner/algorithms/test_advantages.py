"""Advantage estimators: hand-computed values, loop references on ragged batches, edge cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.learner.algorithms import ADV_ESTIMATORS

GROUP_ESTIMATORS = ["grpo", "drgrpo", "rloo", "reinforce_pp_baseline"]


def _outcome_batch(rewards, lengths, groups, T=None):
    """Outcome rewards on each row's last valid token, right padding."""
    T = T or max(max(lengths), 1)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    token_rewards = torch.zeros(len(rewards), T)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        if n:
            token_rewards[i, n - 1] = r
    return token_rewards, mask, torch.tensor(groups)


def _ragged(seed: int, holes: bool = False, dtype=torch.float32):
    """Random batch: groups of 1-4 samples, lengths 0..T, binary or continuous outcome rewards,
    optionally interior masked positions (multi-turn style)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    groups = [gid * 7 - 3 for gid, n in enumerate(sizes) for _ in range(n)]  # arbitrary ids
    B, T = len(groups), int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(B, T, generator=g) > 0.2
    token_rewards = torch.randn(B, T, generator=g, dtype=dtype) * mask
    if seed % 2:  # binary outcomes make all-equal groups common
        token_rewards = (torch.rand(B, T, generator=g) > 0.5).to(dtype) * mask
    values = torch.randn(B, T, generator=g, dtype=dtype)
    return token_rewards, mask, torch.tensor(groups), values


# ------------------------------------------------------------------------------ hand-computed


def test_grpo_hand_computed():
    r, m, g = _outcome_batch([1.0, 0.0, 0.0], [2, 1, 3], [0, 0, 0])
    adv, returns = ADV_ESTIMATORS["grpo"](r, m, g, None, RlAlgorithm())
    # mean = 1/3; deviations 2/3, -1/3, -1/3; unbiased var = (4/9 + 1/9 + 1/9) / 2 = 1/3; std = 0.57735
    # A = (2/3) / 0.57735 = 1.15470, (-1/3) / 0.57735 = -0.57735   (eps 1e-6 is below the tolerance)
    expected = torch.tensor([[1.15470, 1.15470, 0.0], [-0.57735, 0.0, 0.0], [-0.57735, -0.57735, -0.57735]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, adv)


def test_grpo_without_std_and_drgrpo_only_centre():
    r, m, g = _outcome_batch([1.0, 0.0, 0.0], [1, 1, 1], [0, 0, 0])
    # A = R - mean = 1 - 1/3 = 2/3, 0 - 1/3 = -1/3
    expected = torch.tensor([[2 / 3], [-1 / 3], [-1 / 3]])
    no_std, _ = ADV_ESTIMATORS["grpo"](r, m, g, None, RlAlgorithm(norm_by_std=False))
    drgrpo, _ = ADV_ESTIMATORS["drgrpo"](r, m, g, None, RlAlgorithm(norm_by_std=True))  # ignores the switch
    torch.testing.assert_close(no_std, expected)
    torch.testing.assert_close(drgrpo, expected)


def test_rloo_hand_computed():
    r, m, g = _outcome_batch([1.0, 0.0, 0.0, 4.0, 2.0], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1])
    adv, _ = ADV_ESTIMATORS["rloo"](r, m, g, None, RlAlgorithm())
    # group 0: 1 - (0 + 0)/2 = 1;  0 - (1 + 0)/2 = -0.5 (twice);  group 1: 4 - 2 = 2;  2 - 4 = -2
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 2.0, -2.0]))


def test_reinforce_pp_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, returns = ADV_ESTIMATORS["reinforce_pp"](r, m, torch.tensor([0, 1]), None, RlAlgorithm(gamma=0.5))
    # G row 0 = [0.5^2 * 1, 0.5 * 1, 1] = [0.25, 0.5, 1];  row 1 = [0.5 * 2, 2] = [1, 2]
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # batch of 5 tokens: mean = 4.75 / 5 = 0.95; deviations -0.7, -0.45, 0.05, 0.05, 1.05
    # unbiased var = (0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025) / 4 = 0.45; std = 0.670820
    std = math.sqrt(0.45 + 1e-8)
    expected = torch.tensor([[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_hand_computed():
    r, m, g = _outcome_batch([1.0, 0.0, 3.0], [2, 1, 2], [0, 0, 1])
    adv, _ = ADV_ESTIMATORS["reinforce_pp_baseline"](r, m, g, None, RlAlgorithm())
    # group-centred: [0.5, -0.5] and the singleton -> 0; tokens [0.5, 0.5 | -0.5 | 0, 0]
    # mean = 0.5 / 5 = 0.1; deviations 0.4, 0.4, -0.6, -0.1, -0.1; var = (0.16*2 + 0.36 + 0.01*2) / 4 = 0.175
    std = math.sqrt(0.175 + 1e-8)
    expected = torch.tensor([[0.4 / std, 0.4 / std], [-0.6 / std, 0.0], [-0.1 / std, -0.1 / std]])
    torch.testing.assert_close(adv, expected)


def test_gae_hand_computed():
    cfg = RlAlgorithm(gamma=1.0, lam=1.0, whiten_advantages=False)
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, returns = ADV_ESTIMATORS["gae"](r, torch.ones(1, 3), torch.tensor([0]), v, cfg)
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = 1 - V_t; returns = A + V = 1
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))

    cfg = RlAlgorithm(gamma=0.5, lam=0.5, whiten_advantages=False)
    r, v = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 2.0]])
    adv, returns = ADV_ESTIMATORS["gae"](r, torch.ones(1, 2), torch.tensor([0]), v, cfg)
    # delta_1 = 1 + 0.5*0 - 2 = -1, A_1 = -1;  delta_0 = 0 + 0.5*2 - 1 = 0, A_0 = 0 + 0.25*(-1) = -0.25
    # returns = A + V = [0.75, 1.0]
    torch.testing.assert_close(adv, torch.tensor([[-0.25, -1.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.75, 1.0]]))


def test_gae_whitening_gives_zero_mean_unit_std_over_valid_tokens():
    r, m, g, v = _ragged(4)
    m[0, 0] = m[0, -1] = True
    adv, _ = ADV_ESTIMATORS["gae"](r, m, g, v, RlAlgorithm())
    valid = adv[m]
    assert abs(valid.mean().item()) < 1e-5
    assert valid.std().item() == pytest.approx(1.0, rel=1e-3)


# ------------------------------------------------------------------------------ loop references


def _group_reference(token_rewards, mask, groups, kind):
    """Plain Python: per-sequence outcome, per-group baseline."""
    B = token_rewards.shape[0]
    R = [sum(float(token_rewards[i, t]) for t in range(mask.shape[1]) if mask[i, t]) for i in range(B)]
    adv = []
    for i in range(B):
        mates = [R[j] for j in range(B) if int(groups[j]) == int(groups[i])]
        if len(mates) < 2 or max(mates) == min(mates):
            adv.append(0.0)
        elif kind == "grpo":
            adv.append((R[i] - statistics.mean(mates)) / (statistics.stdev(mates) + 1e-6))
        elif kind in ("drgrpo", "reinforce_pp_baseline"):
            adv.append(R[i] - statistics.mean(mates))
        else:  # rloo
            others = [R[j] for j in range(B) if j != i and int(groups[j]) == int(groups[i])]
            adv.append(R[i] - sum(others) / len(others))
    out = torch.tensor([[adv[i] if mask[i, t] else 0.0 for t in range(mask.shape[1])] for i in range(B)])
    return _whiten_reference(out, mask) if kind == "reinforce_pp_baseline" else out


def _whiten_reference(x, mask):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    if not vals:
        return torch.zeros_like(x)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return torch.where(mask, (x - mean) / math.sqrt(var + 1e-8), 0.0)


def _per_row_valid(x, mask, fn):
    """Apply ``fn`` to each row's valid tokens as a list (interior holes removed), scatter back."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for i in range(x.shape[0]):
        idx = [t for t in range(x.shape[1]) if mask[i, t]]
        for t, value in zip(idx, fn(i, idx)):
            out[i, t] = value
    return out


def _gae_reference(r, v, mask, gamma, lam):
    def row(i, idx):
        adv, nxt_v, nxt_a = [], 0.0, 0.0
        for t in reversed(idx):
            delta = float(r[i, t]) + gamma * nxt_v - float(v[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(v[i, t])
            adv.append(nxt_a)
        return adv[::-1]

    return _per_row_valid(r, mask, row)


def _returns_reference(r, mask, gamma):
    def row(i, idx):
        out, running = [], 0.0
        for t in reversed(idx):
            running = float(r[i, t]) + gamma * running
            out.append(running)
        return out[::-1]

    return _per_row_valid(r, mask, row)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_match_loop_reference(seed, name):
    r, m, g, _ = _ragged(seed)
    adv, _ = ADV_ESTIMATORS[name](r, m, g, None, RlAlgorithm(), baselines_B=torch.zeros(r.shape[0]))
    torch.testing.assert_close(adv, _group_reference(r, m, g, name), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(10))
def test_gae_matches_loop_reference_with_interior_holes(seed):
    r, m, g, v = _ragged(seed, holes=True, dtype=torch.float64)
    cfg = RlAlgorithm(gamma=0.9, lam=0.8, whiten_advantages=False)
    adv, returns = ADV_ESTIMATORS["gae"](r, m, g, v, cfg)
    expected = _gae_reference(r, v, m, 0.9, 0.8)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(returns, torch.where(m, expected + v, 0.0))


@pytest.mark.parametrize("seed", range(10))
def test_reinforce_pp_matches_loop_reference_with_interior_holes(seed):
    r, m, g, _ = _ragged(seed, holes=True, dtype=torch.float64)
    adv, returns = ADV_ESTIMATORS["reinforce_pp"](r, m, g, None, RlAlgorithm(gamma=0.7))
    expected = _returns_reference(r, m, 0.7)
    torch.testing.assert_close(returns, expected)
    torch.testing.assert_close(adv, _whiten_reference(expected, m))


# ------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_of_one_has_zero_advantage(name):
    r, m, g = _outcome_batch([5.0, 1.0, 0.0], [2, 2, 2], [0, 1, 1])
    adv, _ = ADV_ESTIMATORS[name](r, m, g, None, RlAlgorithm(), baselines_B=torch.zeros(r.shape[0]))
    assert torch.equal(adv[0], torch.zeros(2))
    assert (adv[1] > 0).all() and (adv[2] < 0).all()


def test_batch_of_singletons_is_zero_even_after_whitening():
    r, m, g = _outcome_batch([5.0, 1.0, 0.0], [2, 1, 2], [0, 1, 2])
    adv, _ = ADV_ESTIMATORS["reinforce_pp_baseline"](r, m, g, None, RlAlgorithm())
    assert torch.equal(adv, torch.zeros(3, 2))


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_all_equal_group_is_exactly_zero(name):
    # 0.1 is not exact in binary: in float32 the mean of seven 0.1s differs from 0.1 by 7.5e-9, which
    # (r - mean) / (0 + 1e-6) would turn into -0.0075. The estimator must return exactly 0.
    r, m, g = _outcome_batch([0.1] * 7 + [1.0, 0.0], [3, 1, 2, 3, 3, 1, 2, 1, 1], [4] * 7 + [9, 9])
    adv, _ = ADV_ESTIMATORS[name](r, m, g, None, RlAlgorithm(), baselines_B=torch.zeros(r.shape[0]))
    assert torch.equal(adv[:7], torch.zeros(7, 3))
    assert adv[7, 0] > 0 > adv[8, 0]


def test_nearly_equal_group_does_not_blow_up():
    r, m, g = _outcome_batch([0.3, 0.3 + 1e-7], [1, 1], [0, 0])
    adv, _ = ADV_ESTIMATORS["grpo"](r, m, g, None, RlAlgorithm())
    assert adv.abs().max() < 0.1  # std ~ 7e-8 < eps = 1e-6, so |A| <= ~0.07


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_empty_rows_give_zeros_and_no_nan(name):
    r, m, g = _outcome_batch([1.0, 0.0, 0.0, 2.0], [3, 0, 2, 0], [0, 0, 0, 1], T=3)
    adv, returns = ADV_ESTIMATORS[name](r, m, g, torch.randn(4, 3), RlAlgorithm(), baselines_B=torch.zeros(r.shape[0]))
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert torch.equal(adv[1], torch.zeros(3)) and torch.equal(adv[3], torch.zeros(3))
    assert torch.equal(returns[1], torch.zeros(3))


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_fully_masked_batch_gives_zeros(name):
    r = torch.randn(3, 4)
    mask, groups = torch.zeros(3, 4, dtype=torch.bool), torch.tensor([0, 0, 1])
    adv, returns = ADV_ESTIMATORS[name](
        r, mask, groups, torch.randn(3, 4), RlAlgorithm(), baselines_B=torch.zeros(r.shape[0])
    )
    assert torch.equal(adv, torch.zeros(3, 4)) and torch.equal(returns, torch.zeros(3, 4))


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
@pytest.mark.parametrize("seed", range(4))
def test_zero_where_masked_and_finite(name, seed):
    r, m, g, v = _ragged(seed, holes=True)
    adv, returns = ADV_ESTIMATORS[name](r, m, g, v, RlAlgorithm(), baselines_B=torch.zeros(r.shape[0]))
    assert adv.shape == returns.shape == m.shape
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert torch.equal(adv[~m], torch.zeros_like(adv[~m])) and torch.equal(returns[~m], torch.zeros_like(returns[~m]))


def test_gae_without_values_says_what_to_configure():
    with pytest.raises(ValueError, match="algorithm.critic"):
        ADV_ESTIMATORS["gae"](torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0]), None, RlAlgorithm())


# ------------------------------------------------------------------------------ gradcheck


def test_gradcheck_gae_with_whitening():
    r, m, g, v = _ragged(6, holes=True, dtype=torch.float64)
    m[0, 0] = True
    cfg = RlAlgorithm(gamma=0.9, lam=0.95, whiten_advantages=True)
    r.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r_, v_: ADV_ESTIMATORS["gae"](r_, m, g, v_, cfg), (r, v))


def test_gradcheck_grpo():
    r, m, g = _outcome_batch([0.3, -1.2, 0.7, 2.0, 0.5], [2, 3, 1, 2, 2], [0, 0, 0, 1, 1])
    r = r.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r_: ADV_ESTIMATORS["grpo"](r_, m, g, None, RlAlgorithm())[0], (r,))
