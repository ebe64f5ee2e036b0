"""Non-finite values at masked positions change neither a loss nor a gradient, in every loss.

Each case puts NaN (or +-inf) at the masked position of ``[[., ., x]]`` with mask ``[[1, 1, 0]]`` and
checks the loss and the gradient equal those of the same inputs with 0 there. The value loss and
the k2 KL loss used to leak NaN into the gradient (``where`` after a nonlinearity passes 0 * NaN).
"""

from __future__ import annotations

import pytest
import torch

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.learner.algorithms import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, LossInputs, aggregate, value_loss
from fleetrl.learner.algorithms.kl import apply_kl_penalty, kl_loss

MASK = torch.tensor([[1.0, 1.0, 0.0]])
BAD = [float("nan"), float("inf"), float("-inf")]


def _grad_of(fn, x):
    x = x.clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


def _check(fn, good, bad_value):
    bad = good.clone()
    bad[0, 2] = bad_value
    loss_good, grad_good = _grad_of(fn, good)
    loss_bad, grad_bad = _grad_of(fn, bad)
    assert torch.isfinite(loss_bad) and loss_bad == loss_good
    assert torch.isfinite(grad_bad).all() and torch.equal(grad_bad, grad_good)


@pytest.mark.parametrize("bad", BAD)
def test_value_loss(bad):
    old, returns = torch.tensor([[0.0, 0.1, 0.3]]), torch.tensor([[1.0, 1.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.0]])
    _check(lambda v: value_loss(v, old, returns, MASK, 0.2).loss, values, bad)
    for bad_old, bad_returns in ((old.clone(), returns.clone()), (old.clone(), returns.clone())):
        bad_old[0, 2], bad_returns[0, 2] = bad, bad  # old values and targets with non-finite padding too
        _check(lambda v: value_loss(v, bad_old, bad_returns, MASK, 0.2).loss, values, 0.0)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_loss(name, bad):
    ref = torch.tensor([[-1.0, -2.0, -1.5]])
    _check(lambda lp: kl_loss(lp, ref, MASK, name, "token-mean")[0], torch.tensor([[-1.2, -1.8, 0.0]]), bad)
    ref_bad = ref.clone()
    ref_bad[0, 2] = bad  # a reference log-prob of -inf in padding
    _check(lambda lp: kl_loss(lp, ref_bad, MASK, name, "token-mean")[0], torch.tensor([[-1.2, -1.8, 0.0]]), 0.0)


@pytest.mark.parametrize("bad", BAD)
def test_kl_reward_penalty(bad):
    kl = torch.tensor([[0.1, 0.2, bad]])
    out = apply_kl_penalty(torch.tensor([[0.0, 1.0, 0.0]]), kl, MASK, 0.5)
    assert out[0].tolist() == pytest.approx([-0.05, 0.9, 0.0]) and torch.isfinite(out).all()


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses(name, bad):
    def loss(lp):
        inp = LossInputs(
            logp=lp,
            old_logp=torch.tensor([[-1.0, -1.1, 0.0]]),
            behav_logp=torch.tensor([[-1.0, -1.3, 0.0]]),
            adv=torch.tensor([[0.5, -0.5, 0.0]]),
            mask=MASK,
        )
        return POLICY_LOSSES[name](inp, RlAlgorithm()).loss

    _check(loss, torch.tensor([[-0.9, -1.2, 0.0]]), bad)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_aggregation_and_entropy_bonus(mode, bad):
    _check(lambda x: aggregate(x * 2.0, MASK, mode, norm_len=4), torch.tensor([[0.3, 0.7, 0.0]]), bad)
