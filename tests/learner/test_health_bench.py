"""The collapse bench's analysis (benchmarks/health_analysis.py) on recorded events and curves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from health_analysis import detection, eval_curve, false_alarms, last_rollback_step, recovery, targets  # noqa: E402


def ev(step, rule, action):
    return {"step": step, "rule": rule, "action": action}


# a divergence injected at step 45: an alert before it (a false alarm), the rule at 48, the rollback line at 48
EVENTS = [
    ev(30, "grad_spike", "alert"),
    ev(48, "mismatch_kl_ceiling", "rollback"),
    ev(48, "rollback", "rollback"),
    ev(52, "entropy_floor", "alert"),
]


def test_detection_delay_rule_and_action():
    d = detection(EVENTS, 45)
    assert d["detected"] and d["delay_steps"] == 3 and d["first_rule"] == "mismatch_kl_ceiling"
    assert d["action"] == "rollback"  # the strongest from the injection on
    assert d["rules"] == ["entropy_floor", "mismatch_kl_ceiling"] and d["events_before_injection"] == 1
    # an event on the injection step itself is a delay of 0; nothing after it: not detected
    assert detection([ev(45, "non_finite", "rollback")], 45)["delay_steps"] == 0
    missed = detection([ev(30, "grad_spike", "alert")], 45)
    assert not missed["detected"] and missed["delay_steps"] is None and missed["action"] == "none"


def test_recovery_within_three_points_of_the_pre_fault_best():
    # best before the fault 0.30 (step 40); after the rollback at 48: 0.20 at 50, 0.28 at 60 (within 3 points)
    curve = [(0, 0.10), (20, 0.25), (40, 0.30), (50, 0.20), (60, 0.28), (70, 0.31)]
    r = recovery(curve, 45, 48, within=40)
    assert r["pre_fault_best"] == 0.30 and r["recovered"] and r["steps_to_recover"] == 12  # 60 - 48
    assert r["accuracy_after"] == 0.31 and r["min_accuracy_after_injection"] == 0.20
    # the window closes before the curve is back: not recovered
    assert not recovery(curve, 45, 48, within=5)["recovered"]
    # 0.265 is 3.5 points below 0.30: not within 3 points
    assert not recovery([(40, 0.30), (50, 0.265)], 45, 48, within=40)["recovered"]
    # no rollback: never "recovered by rollback", though the curve may be back on its own
    r = recovery(curve, 45, None, within=40)
    assert not r["recovered"] and r["back"]


def test_last_rollback_and_eval_curve():
    assert last_rollback_step(EVENTS + [ev(60, "rollback", "rollback")], 45) == 60
    assert last_rollback_step(EVENTS, 50) is None
    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "reward/mean": 0.2},
        {"step": 10, "eval/accuracy": float("nan")},
        {"step": 20, "eval/accuracy": 0.3},
    ]
    assert eval_curve(rows) == [(0, 0.1), (20, 0.3)]


def test_false_alarm_rate_and_the_rule_of_three_bound():
    runs = [{"steps": 100, "events": [ev(30, "grad_spike", "alert")]}, {"steps": 200, "events": []}]
    h = false_alarms(runs)
    assert h["steps"] == 300 and h["alerts"] == 1 and h["rollbacks"] == 0
    assert h["alerts_per_1000_steps"] == pytest.approx(1000 / 300)
    assert h["rollbacks_per_10000_steps_95pct_upper"] == pytest.approx(100.0)  # 3 / 300 steps, per 10,000
    h2 = false_alarms([{"steps": 500, "events": [ev(9, "reward_drop", "rollback"), ev(9, "rollback", "rollback")]}])
    assert (
        h2["rollbacks"] == 1
        and h2["rollbacks_per_1000_steps"] == 2.0
        and h2["rollbacks_per_10000_steps_95pct_upper"] is None
    )


def test_targets():
    f = {
        "divergence": {"detection": {"detected": True, "delay_steps": 3}, "recovery": {"recovered": True}},
        "non_finite": {"detection": {"detected": True, "delay_steps": 25}, "recovery": {"recovered": False}},
    }
    t = targets(f, false_alarms([{"steps": 300, "events": []}]))
    assert t["every_fault_detected"] and not t["divergence_and_non_finite_within_20_steps"]
    assert t["fault_kinds_recovered_by_rollback"].startswith("1 of 2")
    assert t["false_alarms_at_most_1_rollback_per_10000_steps"].startswith("not shown: 0 rollbacks in 300")
