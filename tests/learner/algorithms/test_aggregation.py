"""Loss aggregation: hand-computed values, a plain loop reference, masking and scale invariance."""

from __future__ import annotations

import pytest
import torch

from fleetrl.common.plugins.registry import RegistryError
from fleetrl.learner.algorithms import AGGREGATIONS, aggregate

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _ragged(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return torch.randn(B, T, generator=g, dtype=dtype), mask


def _loop_reference(loss, mask, mode, norm_len):
    """Plain Python over sequences and tokens."""
    seq_values, total, n_tokens = [], 0.0, 0
    for i in range(loss.shape[0]):
        tokens = [float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]]
        if not tokens:
            continue
        total += sum(tokens)
        n_tokens += len(tokens)
        per_seq = {
            "seq-mean-token-sum": sum(tokens),
            "seq-mean-token-mean": sum(tokens) / len(tokens),
            "seq-mean-token-sum-norm": sum(tokens) / norm_len,
        }
        seq_values.append(per_seq.get(mode, 0.0))
    if mode == "token-mean":
        return total / n_tokens if n_tokens else 0.0
    return sum(seq_values) / len(seq_values) if seq_values else 0.0


def test_hand_computed_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # row 2 is empty
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: (6 + 4) / 2 non-empty sequences = 5
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: (6/3 + 4/1) / 2 = (2 + 4) / 2 = 3
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum-norm, L = 4: (6/4 + 4/4) / 2 = (1.5 + 1) / 2 = 1.25
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 4).item() == pytest.approx(1.25)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", MODES)
def test_matches_loop_reference(seed, mode):
    loss, mask = _ragged(seed)
    expected = _loop_reference(loss, mask, mode, norm_len=16)
    assert aggregate(loss, mask, mode, 16).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode):
    loss = torch.randn(3, 4, requires_grad=True)
    out = aggregate(loss, torch.zeros(3, 4, dtype=torch.bool), mode, 8)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(3, 4))


@pytest.mark.parametrize("mode", MODES)
def test_inf_and_nan_in_padding_do_not_leak(mode):
    loss = torch.tensor([[1.0, float("inf")], [2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)
    out = aggregate(loss, mask, mode, 2)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(loss.grad).all()


@pytest.mark.parametrize("mode", MODES)
def test_value_does_not_grow_with_batch_size(mode):
    # Repeating the batch 4 times leaves every mode unchanged: they are all means.
    loss, mask = _ragged(3)
    mask[0, 0] = True
    once = aggregate(loss, mask, mode, 16)
    four_times = aggregate(loss.repeat(4, 1), mask.repeat(4, 1), mode, 16)
    assert four_times.item() == pytest.approx(once.item(), rel=1e-5)


def test_sum_norm_weighs_every_token_the_same_whatever_the_length():
    # One long and one short sequence of unit losses: sum-norm gives (3/4 + 1/4) / 2 = 0.5, i.e. each
    # token weighs 1 / (2 * 4); seq-mean-token-mean would weigh the single short token 3x more.
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", 4).item() == pytest.approx(0.5)


def test_sum_norm_without_length_says_which_key_to_set():
    with pytest.raises(ValueError, match="algorithm.loss_agg_norm_len"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", None)


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(RegistryError) as err:
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "token-sum")
    for mode in MODES:
        assert mode in str(err.value)
    assert sorted(AGGREGATIONS) == sorted(MODES)


def test_gradcheck_seq_mean_token_mean():
    loss, mask = _ragged(5, dtype=torch.float64)
    mask[0, 0] = True
    loss.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: aggregate(x, mask, "seq-mean-token-mean"), (loss,))
