"""Issue 30, item 1: a reward that fails or never scores is visible and stops the run, naming the reward."""

from __future__ import annotations

import json

from fleetrl.app.launch.status import StatusLine
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.common.config.schema import RewardSpec
from fleetrl.learner.completions import reward_part_metrics
from fleetrl.learner.report import rollout_reward_note
from fleetrl.rollout.rewards import RewardInput, RewardScorer

USER = "tests.rollout.user_rewards"


def scorer(*specs: RewardSpec, stop_after: int = 16) -> RewardScorer:
    return RewardScorer(list(specs), timeout_s=5.0, workers=2, on_failure="zero", stop_after=stop_after)


def inputs(n: int, prefix: str = "r") -> list[RewardInput]:
    return [RewardInput(prompt="p", response=f"{prefix}{i}", answer="1", metadata={}) for i in range(n)]


def test_a_reward_failing_on_every_sample_is_hopeless_and_named():
    s = scorer(RewardSpec(name="python", args={"function": f"{USER}:boom"}))
    try:
        s.score(inputs(8))
        assert s.hopeless() is None  # too few samples yet to judge
        s.score(inputs(8))
        why = s.hopeless()
        assert why is not None
        assert "no sample got a usable reward in the first 16" in why
        assert "'boom' (rollout.rewards[0]) failed on 16 of 16 samples" in why and "ValueError" in why
    finally:
        s.close()


def test_a_reward_returning_none_for_every_sample_is_hopeless_and_named():
    s = scorer(RewardSpec(name="python", args={"function": f"{USER}:no_score"}))
    try:
        s.score(inputs(16))
        why = s.hopeless()
        assert why is not None and "'no_score' (rollout.rewards[0]) returned None (no score) for all 16" in why
    finally:
        s.close()


def test_one_usable_sample_is_not_hopeless():
    # odd_values: "ok" scores True (1.0); the other responses fail or are None
    s = scorer(RewardSpec(name="python", args={"function": f"{USER}:odd_values"}))
    try:
        s.score(
            [
                RewardInput(prompt="p", response=r, answer=None, metadata={})
                for r in ["nan", "none", "text"] * 5 + ["ok"]
            ]
        )
        assert s.hopeless() is None
    finally:
        s.close()


def test_a_reward_that_starts_failing_mid_run_stops_the_server_naming_it(caplog):
    """Issue 30: a reward that worked for the first samples and then raises on every one (a judge that went
    away) must stop the run too, not only one that never worked."""
    s = scorer(RewardSpec(name="python", args={"function": f"{USER}:fails_late"}), stop_after=16)
    try:
        s.score(inputs(40))  # 40 usable samples
        s.score(inputs(7, "late"))
        assert s.hopeless() is None  # 7 in a row: not yet
        with caplog.at_level("WARNING", logger="fleetrl.rollout.rewards.scorer"):
            s.score(inputs(8, "late"))  # 15 in a row; the warning came at 8, half way
        assert s.hopeless() is None
        warned = [r.getMessage() for r in caplog.records if "no usable reward" in r.getMessage()]
        assert len(warned) == 1 and "the last 8 samples" in warned[0] and "stops at 16 in a row" in warned[0]
        s.score(inputs(1, "late"))
        why = s.hopeless()
    finally:
        s.close()
    assert why is not None
    assert "the rewards stopped working: the last 16 samples got no usable reward (after 40 usable ones)" in why
    assert "'fails_late' (rollout.rewards[0]) failed on 16 of 16 samples" in why and "ConnectionError" in why
    assert "rollout.reward_stop_after" in why


def test_a_usable_sample_ends_the_streak_and_zero_never_stops():
    s = scorer(RewardSpec(name="python", args={"function": f"{USER}:fails_late"}), stop_after=16)
    try:
        s.score(inputs(15, "late"))
        s.score(inputs(1))  # one usable sample: the count starts again
        s.score(inputs(15, "late"))
        assert s.hopeless() is None
    finally:
        s.close()
    never = scorer(RewardSpec(name="python", args={"function": f"{USER}:boom"}), stop_after=0)
    try:
        never.score(inputs(64))
        assert never.hopeless() is None  # rollout.reward_stop_after=0: count and show, never stop
    finally:
        never.close()


def test_failed_parts_ride_the_group_and_leave_the_learner_mean():
    s = scorer(
        RewardSpec(name="python", args={"function": f"{USER}:odd_values"}),
        RewardSpec(name="regex", weight=0.5, args={"pattern": "."}),
    )
    try:
        results = s.score([RewardInput(prompt="p", response=r, answer=None, metadata={}) for r in ["nan", "ok"]])
    finally:
        s.close()
    assert results[0].failed_parts == ("odd_values",) and results[1].failed_parts == ()
    g = m.build_group(
        "g",
        "p0",
        0,
        [1],
        [([5], [-1.0]), ([5], [-1.0])],
        [r.reward for r in results],
        reward_parts=[dict(r.parts) for r in results],
        failed=[r.failed for r in results],
        failed_parts=[list(r.failed_parts) for r in results],
    )
    wire = m.decode_group(m.encode(g))  # the field survives the wire
    assert wire.failed_parts == [["odd_values"], []]
    out = reward_part_metrics([wire])
    # odd_values: "nan" failed (its 0.0 is no score), "ok" scored 1.0 -> mean 1.0, not (0 + 1) / 2
    assert out["reward/odd_values/mean"] == 1.0
    assert out["reward/odd_values/failed_frac"] == 0.5 and out["reward/failed_frac"] == 0.5
    assert out["reward/regex/mean"] == 1.0 and "reward/regex/failed_frac" not in out


def test_a_reward_failing_everywhere_has_no_mean_only_a_failed_share():
    g = m.build_group(
        "g",
        "p0",
        0,
        [1],
        [([5], [-1.0])] * 2,
        [0.0, 0.0],
        reward_parts=[{"boom": 0.0}] * 2,
        failed=[True, True],
        failed_parts=[["boom"], ["boom"]],
    )
    out = reward_part_metrics([g])
    assert "reward/boom/mean" not in out and out["reward/boom/failed_frac"] == 1.0 and out["reward/failed_frac"] == 1.0


def write_rollout_metrics(run_dir, samples, failed, unscored):
    row = {"reward/samples_total": samples, "reward/failed_total": failed, "reward/unscored_total": unscored}
    (run_dir / "rollout-0.metrics.jsonl").write_text(json.dumps(row) + "\n")


def test_status_line_summary_and_report_name_reward_failures(tmp_path):
    cfg = load_config(None, [])
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time": 1.0, "reward/mean": 0.0, "batch/samples": 4}) + "\n"
    )
    write_rollout_metrics(tmp_path, 40, 12, 3)
    line = StatusLine(cfg, tmp_path, enabled=False)
    line.update()
    assert "reward failed on 12/40 samples, unscored 3/40" in line.render()
    assert "reward failed on 12/40 samples" in line.summary(10.0)
    assert "12 of 40 scored samples had a failed reward, 3 got no score" in rollout_reward_note(tmp_path)


def test_a_healthy_run_says_nothing_about_rewards(tmp_path):
    cfg = load_config(None, [])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.0, "reward/mean": 0.5}) + "\n")
    write_rollout_metrics(tmp_path, 40, 0, 0)
    line = StatusLine(cfg, tmp_path, enabled=False)
    line.update()
    assert "reward failed" not in line.render() and "unscored" not in line.render()
    assert rollout_reward_note(tmp_path) == ""
