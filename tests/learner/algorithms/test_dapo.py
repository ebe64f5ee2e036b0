"""DAPO's dynamic sampling filter and overlong reward shaping."""

from __future__ import annotations

import pytest
import torch

from fleetrl.learner.algorithms import dynamic_sampling_filter, overlong_penalty


def test_dynamic_sampling_drops_whole_groups_without_signal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 0.1, 0.1])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    keep, n_dropped = dynamic_sampling_filter(rewards, groups)
    # group 0 all 1 (dropped), group 1 mixed (kept), group 2 alone (dropped), group 3 all 0.1 (dropped)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert n_dropped == 3


def test_dynamic_sampling_keeps_everything_with_signal_and_can_drop_everything():
    keep, n_dropped = dynamic_sampling_filter(torch.tensor([0.0, 1.0, 2.0, 0.5]), torch.tensor([9, 9, 4, 4]))
    assert keep.all() and n_dropped == 0
    keep, n_dropped = dynamic_sampling_filter(torch.zeros(6), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert not keep.any() and n_dropped == 3


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # L_max = 10, L_cache = 4: zone starts at 6; penalty = -clip((|y| - 6) / 4, 0, 1)
    #   5 -> 0, 6 -> 0, 7 -> -0.25, 8 -> -0.5, 10 -> -1, 12 -> -1
    out = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    # scaled by the penalty at max length: 0.5
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), 0.5 * out)


@pytest.mark.parametrize("seed", range(5))
def test_overlong_penalty_is_non_positive_and_monotone(seed):
    lengths = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(seed)).sort().values
    out = overlong_penalty(lengths, max_len=256, buffer_len=64, penalty=2.0)
    assert (out <= 0).all() and (out >= -2.0).all()
    assert (out[1:] <= out[:-1]).all()


def test_gradcheck_overlong_penalty_inside_the_zone():
    lengths = torch.tensor([200.5, 230.25, 250.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: overlong_penalty(x, 256, 64, 1.0), (lengths,))
