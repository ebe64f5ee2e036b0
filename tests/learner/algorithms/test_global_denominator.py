"""One global denominator across micro-batches and ranks (issue 29).

Hand-computed: ``aggregate`` with ``denom`` on small matrices, and the sum of the per-micro-batch parts
against the aggregate of the whole batch. Real: two learner ranks under torchrun over gloo, each with
its own number of tokens and sequences, take one step of the learner's update; the gradient equals, to
1e-6, that of one process taking the policy loss of the concatenated batch (global_denominator_ranks.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetrl.learner.algorithms import aggregate, global_counts, per_token
from fleetrl.learner.algorithms.aggregation import counts
from tests.conftest import free_port

HERE = Path(__file__).parent
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# two micro-batches: 3 + 1 valid tokens in 2 sequences (one row empty), and 2 tokens in 1 sequence
L1 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
M1 = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
L2 = torch.tensor([[6.0, 8.0, 0.0]])
M2 = torch.tensor([[1, 1, 0]])


def test_counts_are_valid_tokens_and_non_empty_sequences():
    assert counts(M1).tolist() == [4.0, 2.0]
    local, total = global_counts([M1, M2], torch.device("cpu"))
    assert [c.tolist() for c in local] == [[4.0, 2.0], [2.0, 1.0]] and total.tolist() == [6.0, 3.0]
    assert per_token("token-mean") and not per_token("seq-mean-token-mean")
    with pytest.raises(KeyError, match="algorithm.loss_agg"):
        per_token("token-men")


@pytest.mark.parametrize(
    "mode, denom, expected",
    [
        ("token-mean", 6.0, (1 + 2 + 3 + 4) / 6),  # sum over the global token count
        ("seq-mean-token-sum", 3.0, (6 + 4) / 3),  # per-sequence sums over the global sequences
        ("seq-mean-token-mean", 3.0, (2 + 4) / 3),  # per-sequence means over the global sequences
        ("seq-mean-token-sum-norm", 3.0, (6 / 4 + 4 / 4) / 3),  # per-sequence sums / L over the global sequences
    ],
)
def test_aggregate_divides_by_the_global_count(mode, denom, expected):
    assert float(aggregate(L1, M1, mode, 4, denom=denom)) == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_parts_over_the_global_count_add_up_to_the_whole_batch(mode):
    _, total = global_counts([M1, M2], torch.device("cpu"))
    denom = float(total[0 if per_token(mode) else 1])
    parts = aggregate(L1, M1, mode, 4, denom=denom) + aggregate(L2, M2, mode, 4, denom=denom)
    whole = aggregate(torch.cat([L2, L1]), torch.cat([M2, M1]), mode, 4)
    assert float(parts) == pytest.approx(float(whole), abs=1e-6)
    # the micro-batches' own means averaged are not the whole batch's mean (3 vs 2 tokens, 2 vs 1 sequences)
    own = 0.5 * (aggregate(L1, M1, mode, 4) + aggregate(L2, M2, mode, 4))
    assert abs(float(own) - float(whole)) > 0.1


def test_denominator_of_a_single_call_is_bitwise_its_own_count():
    """One rank, one micro-batch: the global count is the call's own, and the value is bitwise unchanged."""
    for mode in MODES:
        n = counts(M1)[0 if per_token(mode) else 1].item()
        assert torch.equal(aggregate(L1, M1, mode, 4, denom=n), aggregate(L1, M1, mode, 4))


def test_an_empty_step_divides_by_one_not_zero():
    zero = torch.zeros(1, 3)
    assert float(aggregate(zero, zero, "token-mean", denom=0.0)) == 0.0


def _two_ranks(tmp_path: Path, model_dir: str, zero_stage: int) -> dict:
    out = tmp_path / f"grads-z{zero_stage}.json"
    root = HERE.parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(HERE / "global_denominator_ranks.py"),
            "--model",
            model_dir,
            "--zero-stage",
            str(zero_stage),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def _check(result: dict) -> None:
    assert set(result) == set(MODES)
    for mode, r in result.items():
        assert r["max_abs_grad"] > 1e-4, (mode, r)  # a real gradient, not zeros
        assert r["max_abs_diff"] <= 1e-6, (mode, r)  # 2 ranks, several micro-batches each == one concatenated batch
        assert r["old_convention_diff"] > 1e-4, (mode, r)  # the per-rank mean of means is measurably different


@pytest.mark.slow
def test_two_ranks_equal_one_rank_on_the_concatenated_batch(tmp_path, tiny_model_dir):
    _check(_two_ranks(tmp_path, tiny_model_dir, 0))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_under_zero_equal_one_rank_on_the_concatenated_batch(tmp_path, tiny_model_dir, zero_stage):
    _check(_two_ranks(tmp_path, tiny_model_dir, zero_stage))


# ------------------------------------------------------------------ GSPO with token-level TIS (issue 29, item 4)
def _gspo(gspo_level: str) -> torch.Tensor:
    from fleetrl.common.config.algorithm import OffPolicyConfig, RlAlgorithm
    from fleetrl.learner.algorithms import POLICY_LOSSES, LossInputs

    # one sequence of two tokens, ratio 1 (logp = old), A = 1: each token's clipped loss is -1.
    # log rho_t = old_t - mu_t = [1.0, -0.5]; cap C = 2.
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    inp = LossInputs(
        logp=logp,
        old_logp=torch.zeros(1, 2, dtype=torch.float64),
        behav_logp=torch.tensor([[-1.0, 0.5]], dtype=torch.float64),
        adv=torch.ones(1, 2, dtype=torch.float64),
        mask=torch.ones(1, 2),
    )
    cfg = RlAlgorithm(
        policy_loss="gspo",
        loss_agg="token-mean",
        off_policy=OffPolicyConfig(mode="tis", cap=2.0, gspo_level=gspo_level),
    )
    return POLICY_LOSSES["gspo"](inp, cfg).loss.detach()


def test_gspo_token_level_tis_weights_each_token():
    # token level: w = [min(e^1, 2), e^-0.5] = [2, 0.60653]; loss = -(2 + 0.60653) / 2
    assert float(_gspo("token")) == pytest.approx(-(2.0 + math.exp(-0.5)) / 2, abs=1e-12)
    # sequence level (the default): log rho_i = mean(1.0, -0.5) = 0.25, w = e^0.25 on both tokens
    assert float(_gspo("sequence")) == pytest.approx(-math.exp(0.25), abs=1e-12)


def test_gspo_level_is_a_checked_config_key():
    from fleetrl.common.config import ConfigError, load_config

    root = HERE.parents[2]
    cfg = load_config(str(root / "configs" / "gspo.yaml"), ["algorithm.off_policy.gspo_level=token"])
    assert cfg.algorithm.off_policy.gspo_level == "token"
    assert load_config(str(root / "configs" / "gspo.yaml")).algorithm.off_policy.gspo_level == "sequence"
    with pytest.raises(ConfigError, match="gspo_level"):
        load_config(str(root / "configs" / "gspo.yaml"), ["algorithm.off_policy.gspo_level=tokens"])
