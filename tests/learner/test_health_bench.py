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


def test_recovery_is_judged_50_steps_after_the_last_rollback_against_the_unfaulted_run():
    from health_recovery import compare, summarize

    base = {"inject_at": 45, "exit_code": 0, "events": [], "curve": [(s, 0.25 + s / 1000) for s in range(0, 151, 10)]}
    # detected at 50 (delay 5), rolled back at 50 and 60; judged over the evaluations at 110, 120, 130
    run = {
        **base,
        "events": [
            ev(50, "reward_hacking", "rollback"),
            ev(50, "rollback", "rollback"),
            ev(60, "reward_hacking", "rollback"),
            ev(60, "rollback", "rollback"),
        ],
        "curve": [(s, a - (0.2 if 50 <= s <= 80 else 0.02)) for s, a in base["curve"]],
    }
    r = compare(run, base)
    assert (r["detected"], r["delay_steps"], r["rollbacks"], r["recovered_from_step"]) == (True, 5, 2, 60)
    assert r["judged_at"] == [110, 120, 130] and r["gap"] == pytest.approx(0.02) and r["recovered"]  # within 3
    assert r["accuracy_lost_max"] == pytest.approx(0.2)
    # 4 points short is not recovered; a run the monitor stopped is judged at its last evaluation
    worse = compare({**run, "curve": [(s, a - 0.04) for s, a in base["curve"]]}, base)
    assert worse["gap"] == pytest.approx(0.04) and not worse["recovered"]
    stopped = compare({**run, "exit_code": 3, "curve": base["curve"][:8]}, base)
    assert stopped["stopped"] and stopped["judged_at"] == [70] and stopped["action"] == "stop"
    table = summarize({"reward_hack-s1": run, "unfaulted-s1": base}, ["reward_hack"], [1])
    assert table["faults"]["reward_hack"]["recovered_median"]
    assert table["targets"]["detected_within_20_steps"].startswith("1 of 1")


def test_a_run_that_died_is_not_recovered_and_is_the_worst_seed_of_the_median():
    # entropy_collapse seeds 2 and 3 (2026-12-06, fifth session): the learner died with FleetIdle (every group
    # refused for batch_wait_s) 2 and 5 points under the unfaulted run at its last evaluation; that was counted
    # as recovered within 3 points, and made the median seed look recovered
    from health_recovery import compare, summarize

    base = {"inject_at": 45, "exit_code": 0, "events": [], "curve": [(s, 0.3) for s in range(0, 151, 10)]}
    rolled = [ev(48, "mismatch_kl_ceiling", "rollback"), ev(48, "rollback", "rollback")]
    recovered = {**base, "events": rolled}
    died = {**base, "exit_code": 1, "events": rolled, "curve": [(s, 0.28) for s in range(0, 51, 10)]}
    r = compare(died, base)
    assert r["died"] and r["judged_at"] == [50] and r["gap"] == pytest.approx(0.02) and not r["recovered"]
    runs = {"unfaulted-s1": base, "unfaulted-s2": base, "unfaulted-s3": base}
    one = summarize(
        {**runs, "entropy_collapse-s1": recovered, "entropy_collapse-s2": died, "entropy_collapse-s3": died},
        ["entropy_collapse"],
        [1, 2, 3],
    )["faults"]["entropy_collapse"]
    assert one["median_seed_died"] and one["median_gap"] is None and not one["recovered_median"]
    two = summarize(
        {**runs, "entropy_collapse-s1": recovered, "entropy_collapse-s2": recovered, "entropy_collapse-s3": died},
        ["entropy_collapse"],
        [1, 2, 3],
    )["faults"]["entropy_collapse"]
    assert not two["median_seed_died"] and two["median_gap"] == pytest.approx(0.0) and two["recovered_median"]


def test_a_run_its_learner_stopped_counts_as_a_stop_not_a_failure(tmp_path):
    # `fleetrl run` exits 1 when its learner exits 3 (the monitor's stop); health_recovery.py took those runs
    # for failures (no done.json, rerun every time, never compared as stopped): entropy_collapse-s2 and
    # stale_fleet-s2 on 2026-12-06
    from health_recovery import learner_stopped

    (tmp_path / "run.log").write_text(
        "fleetrl run: learner    exit 3: health: rollback limit reached: 3 rollbacks done\nfleetrl run: broker exit 0\n"
    )
    assert learner_stopped(tmp_path)
    (tmp_path / "run.log").write_text("fleetrl run: learner    exit 1: Traceback ...\n")
    assert not learner_stopped(tmp_path)
    assert not learner_stopped(tmp_path / "missing")
