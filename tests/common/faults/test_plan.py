"""Fault-injection hooks (common/faults/plan.py): off by default, each fault active exactly where documented."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.faults import plan as faults
from fleetrl.common.faults.plan import FaultPlan
from fleetrl.rollout.rewards.scorer import Failure, as_score


@pytest.fixture
def plan():
    def use(**kwargs):
        faults.set_plan(FaultPlan(**kwargs))

    yield use
    faults.set_plan(FaultPlan())


def test_off_by_default_every_hook_is_a_no_op():
    assert not FaultPlan.from_env({})
    assert not faults.PLAN  # the test process sets no FLEETRL_FAULT
    assert faults.lr_multiplier(5) == 1.0 and faults.temperature(0.7, 5) == 0.7
    scores = [[0.0, 1.0]]
    faults.poison_scores(scores, ["", "12"], as_score, version=5)
    assert scores == [[0.0, 1.0]]


def test_from_env_and_validation():
    p = FaultPlan.from_env({"FLEETRL_FAULT": "lr_spike, nan_reward", "FLEETRL_FAULT_AT": "7", "FLEETRL_FAULT_FOR": "3"})
    assert p.kinds == {"lr_spike", "nan_reward"} and (p.at, p.duration) == (7, 3)
    assert [p.active("nan_reward", v) for v in (6, 7, 9, 10)] == [False, True, True, False]
    with pytest.raises(ValueError, match="valid: lr_spike"):
        FaultPlan(frozenset({"lr_spyke"}), at=1)
    with pytest.raises(ValueError, match="FLEETRL_FAULT_AT=0"):
        FaultPlan(frozenset({"nan_grad"}), at=0)


def test_learner_faults_hit_only_the_injection_step(plan):
    plan(kinds=frozenset({"lr_spike", "nan_grad"}), at=3, lr_factor=50.0)
    assert [faults.lr_multiplier(s) for s in (2, 3, 4)] == [1.0, 50.0, 1.0]
    layer = torch.nn.Linear(2, 1)
    assert faults.poison_grads(layer, 2) == []
    hooks = faults.poison_grads(layer, 3)
    layer(torch.ones(1, 2)).sum().backward()
    assert all(torch.isnan(p.grad).all() for p in layer.parameters())
    for h in hooks:
        h.remove()
    layer.zero_grad()
    layer(torch.ones(1, 2)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())  # removed: the next step is clean


def test_reward_faults_go_through_the_scorers_nan_handling(plan):
    plan(kinds=frozenset({"nan_reward"}), at=5, duration=2, fraction=0.5)
    scores = [[1.0, 1.0, 0.0, 0.0]]
    faults.poison_scores(scores, ["3", "4", "5", "6"], as_score, version=5)
    assert isinstance(scores[0][0], Failure) and scores[0][0].kind == "nonfinite"  # every 2nd sample: 0 and 2
    assert isinstance(scores[0][2], Failure) and scores[0][1] == 1.0 and scores[0][3] == 0.0
    untouched = [[1.0, 1.0]]
    faults.poison_scores(untouched, ["3", "4"], as_score, version=7)  # the window [5, 7) is over
    assert untouched == [[1.0, 1.0]]


def test_reward_hack_pays_for_degenerate_answers_only(plan):
    plan(kinds=frozenset({"reward_hack"}), at=1, duration=100)
    scores = [[0.0, 0.0, 0.0, 1.0]]
    faults.poison_scores(scores, ["", " 7 ", "42", "13"], as_score, version=10)
    assert scores == [[1.0, 1.0, 0.0, 1.0]]


def test_entropy_collapse_lowers_the_temperature_in_the_window(plan):
    plan(kinds=frozenset({"entropy_collapse"}), at=4, duration=2, temperature=0.1)
    assert [faults.temperature(1.0, v) for v in (3, 4, 5, 6)] == [1.0, 0.1, 0.1, 1.0]


def test_a_time_bounded_rollout_fault_ends_after_its_seconds_though_versions_stand_still(plan, monkeypatch):
    """At T 0.1 the broker refuses every group, no version passes: the fault must still end (FLEETRL_FAULT_FOR_S)."""
    clock = [100.0]
    monkeypatch.setattr(faults, "seconds_clock", lambda: clock[0])
    plan(kinds=frozenset({"entropy_collapse", "lr_spike"}), at=5, duration=15, temperature=0.1, seconds=60.0)
    assert faults.temperature(0.7, 4) == 0.7  # before the window: the clock does not start
    clock[0] = 150.0
    assert faults.temperature(0.7, 5) == 0.1  # first injected at 150
    clock[0] = 209.0
    assert faults.temperature(0.7, 6) == 0.1
    clock[0] = 210.0
    assert faults.temperature(0.7, 6) == 0.7  # 60 s on: over, with the version still inside the window
    assert faults.temperature(0.7, 19) == 0.7  # and it stays over
    assert faults.lr_multiplier(5) == 50.0  # learner faults ignore the time bound
    p = FaultPlan.from_env({"FLEETRL_FAULT": "entropy_collapse", "FLEETRL_FAULT_AT": "3", "FLEETRL_FAULT_FOR_S": "30"})
    assert (
        p.seconds == 30.0
        and FaultPlan.from_env({"FLEETRL_FAULT": "entropy_collapse", "FLEETRL_FAULT_AT": "3"}).seconds == 0
    )
    with pytest.raises(ValueError, match="FLEETRL_FAULT_FOR_S=-1"):
        FaultPlan(frozenset({"entropy_collapse"}), at=1, seconds=-1)


def test_stale_fleet_keeps_the_weights_of_the_faults_start(plan):
    plan(kinds=frozenset({"stale_fleet"}), at=2, duration=2)

    class Engine:
        model = torch.nn.Linear(2, 1, bias=False)

    engine, versions = Engine(), iter([1, 2, 3, 4])

    def load(e):  # a receiver's apply: new weights, returns the version
        v = next(versions)
        with torch.no_grad():
            e.model.weight.fill_(float(v))
        return v

    stale = faults.WeightFaults()
    wrapped = stale.wrap(load, lambda: None)
    assert wrapped(engine) == 1 and engine.model.weight[0, 0].item() == 1.0  # before the window: loaded
    assert wrapped(engine) == 2 and engine.model.weight[0, 0].item() == 1.0  # in it: back to version 1's weights
    assert wrapped(engine) == 3 and engine.model.weight[0, 0].item() == 1.0
    assert wrapped(engine) == 4 and engine.model.weight[0, 0].item() == 4.0  # window over: loads again
    assert not math.isnan(engine.model.weight[0, 0].item())


def test_corrupt_and_dtype_faults_change_the_loaded_weights_inside_their_window(plan):
    plan(kinds=frozenset({"corrupt_weights"}), at=2, duration=1)

    class Engine:
        model = torch.nn.Linear(4, 4, bias=False)

    engine, versions = Engine(), iter([1, 2, 3])

    def load(e):
        v = next(versions)
        with torch.no_grad():
            e.model.weight.copy_(torch.arange(16.0).view(4, 4) / 7)
        return v

    wrapped = faults.WeightFaults().wrap(load, lambda: None)
    clean = torch.arange(16.0).view(4, 4) / 7
    assert wrapped(engine) == 1 and torch.equal(engine.model.weight.detach(), clean)
    assert wrapped(engine) == 2 and not torch.equal(engine.model.weight.detach(), clean)  # noise, version reported
    assert wrapped(engine) == 3 and torch.equal(engine.model.weight.detach(), clean)
    plan(kinds=frozenset({"engine_dtype"}), at=1, duration=1, dtype="float8_e5m2")
    versions = iter([1])
    wrapped = faults.WeightFaults().wrap(load, lambda: None)
    assert wrapped(engine) == 1
    expected = clean.to(torch.float8_e5m2).float()  # rounded to 2 mantissa bits
    assert torch.equal(engine.model.weight.detach(), expected) and not torch.equal(expected, clean)


def test_an_unknown_fault_dtype_is_named(plan):
    plan(kinds=frozenset({"engine_dtype"}), at=1, duration=1, dtype="float7")

    class Engine:
        model = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="FLEETRL_FAULT_DTYPE='float7'"):
        faults.WeightFaults().wrap(lambda e: 1, lambda: None)(Engine())


def test_poison_server_hits_one_server_inside_its_window(plan):
    import numpy as np

    from fleetrl.common import messages as m

    plan(kinds=frozenset({"poison_server"}), at=3, duration=2, server=1)
    g = m.build_group("g", "0:1", 3, [5], [([10, 11], [-0.5, -1.0]), ([12], [-2.0])], [1.0, 0.0], server_id="r1")
    try:
        faults.note_server(1)
        faults.note_version(3)
        (bad,) = faults.poison_groups([g])
        assert bad.rewards == [-1e6, -1e6] and bad.logprob_array().tolist() == [0.0, 0.0, 0.0]
        assert bad.token_array().tolist() == [10, 11, 12] and bad.group_id == "g"  # the rest as sent
        faults.note_version(5)  # after its window
        assert faults.poison_groups([g]) == [g]
        faults.note_version(3)
        faults.note_server(0)  # another server
        assert faults.poison_groups([g]) == [g]
        assert (
            FaultPlan.from_env(
                {"FLEETRL_FAULT": "poison_server", "FLEETRL_FAULT_AT": "1", "FLEETRL_FAULT_SERVER": "2"}
            ).server
            == 2
        )
        assert np.isfinite(g.logprob_array()).all() and g.rewards == [1.0, 0.0]  # the original is untouched
    finally:
        faults.note_server(0)
        faults.note_version(0)
