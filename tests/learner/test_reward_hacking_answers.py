"""reward_hacking's held-out answers evidence: the held-out greedy answers got shorter while the reward holds.

Recorded streams (tests/learner/data/reward_hack_streams.json): reward/mean per step and the held-out
evaluations of the recovery runs of 2026-12-06, the reward_hack fault from step 45. Before this evidence the
rule fired on held-out accuracy only, 19-29 steps after the onset (docs/notes/issue-27.md, fourth session)
and missed 4 of the 12 runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fleetrl.common.config.learner import HealthConfig, HealthRule
from fleetrl.learner.health import HealthMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from health_analysis import hack_onset  # noqa: E402

RUNS = json.loads((Path(__file__).parent / "data" / "reward_hack_streams.json").read_text())["runs"]
LEN, ACC = "eval/response_len_mean", "eval/accuracy"


def monitor() -> HealthMonitor:
    return HealthMonitor(HealthConfig(rules=[HealthRule(name="reward_hacking", action="rollback")]), None)


def rows(name: str) -> list[tuple[int, dict]]:
    run = RUNS[name]
    out = {s: {"reward/mean": r} for s, r in run["reward"]}
    for s, acc, length in run["evals"]:
        out.setdefault(s, {}).update({ACC: acc, LEN: length})
    return sorted(out.items())


def first_event(name: str, metric: str | None = None, after: int = 45):
    """(step, event, where its evidence starts) of the first event from step ``after`` (of ``metric`` if given)."""
    m = monitor()
    for step, row in rows(name):
        fired = m.observe(step, row)
        events = [e for e in fired if metric is None or e.metric == metric]
        if events and step >= after:
            return step, events[0], m.onsets["reward_hacking"][0]
        if fired:  # an earlier rollback (p10/persistent-s2 at step 40, before the fault): as health_replay.py does
            m.reset_after_rollback(step)
    return None, None, None


# (run, the step the evidence fires): the first held-out evaluation past 3% shorter than its last three
# clean ones; before: held-out accuracy only (p10 s1 80, s2 90, s3 missed; persistent 90 / missed / 80;
# p5 85 / missed / 80; persistent 90 / 90 / 129)
FIRES = {
    "p10/reward_hack-s1": 70,
    "p10/reward_hack-s2": 90,
    "p10/reward_hack-s3": 80,
    "p10/persistent-s1": 80,
    "p10/persistent-s2": 90,
    "p10/persistent-s3": 70,
    "p5/reward_hack-s1": 75,
    "p5/reward_hack-s2": 70,
    "p5/reward_hack-s3": 70,
    "p5/persistent-s1": 80,
    "p5/persistent-s2": 80,
    "p5/persistent-s3": 75,
}


@pytest.mark.parametrize("name,fires", FIRES.items())
def test_every_recorded_hack_is_caught_within_20_steps_of_its_onset(name, fires):
    step, event, since = first_event(name)
    # p10/reward_hack-s2: the held-out accuracy fell past 0.1 at the same evaluation, and is judged first
    assert step == fires and event.metric == (ACC if name == "p10/reward_hack-s2" else LEN)
    live = min((s for s, _ in RUNS[name]["live_events"] if s >= 45), default=None)
    assert live is None or step <= live  # no later than what the run did: readable from the recording
    onset = hack_onset([(s, length) for s, _, length in RUNS[name]["evals"]], 45)["onset_step"]
    assert onset is not None and step - onset <= 20
    # the evidence starts after the last evaluation before it: the rollback goes to a checkpoint before that
    assert 45 < since <= step - (10 if name.startswith("p10") else 5) + 1


@pytest.mark.parametrize("name", [n for n in RUNS if "unfaulted" in n])
def test_quiet_on_the_unfaulted_runs(name):
    # (p5/unfaulted-s3 has the held-out accuracy path's known false rollback at step 130, not this evidence's)
    assert first_event(name, LEN) == (None, None, None)


@pytest.mark.parametrize("name", ["p10/divergence-s1", "p10/divergence-s2", "p10/divergence-s3"])
def test_a_divergence_is_not_taken_for_a_hack(name):
    # the LR x50 divergence shortens the held-out answers to 1.0-1.3 tokens at step 50, but its reward is 0
    # for the steps before: reward_drop's (at 53-54 live), not this rule's
    # (and its eval at step 50, answers of 5.0 tokens, longer, does not become a baseline either)
    assert first_event(name, LEN) == (None, None, None)


def stream(lengths: list[float], reward: float = 0.4, every: int = 10):
    """Reward ``reward`` every step; held-out answers of these lengths every ``every`` steps."""
    out = []
    for i, length in enumerate(lengths):
        for j in range(1, every + 1):
            step = i * every + j
            row = {"reward/mean": reward}
            if j == every:
                row.update({ACC: 0.3, LEN: length})
            out.append((step, row))
    return out


def fired(m: HealthMonitor, rows) -> dict[int, list]:
    out = {}
    for step, row in rows:
        events = m.observe(step, row)
        if events:
            out[step] = events
    return out


def test_a_slow_drift_moves_the_baseline_a_fall_does_not():
    # 1% shorter per evaluation: 2% under the mean of the last three; then a 5% fall fires at once
    drift = [3.5 * 0.99**i for i in range(12)]
    assert fired(monitor(), stream(drift)) == {}
    events = fired(monitor(), stream([3.5, 3.5, 3.5, 3.45, 3.3]))
    (step,) = events
    assert step == 50 and events[50][0].threshold == pytest.approx(0.97 * 3.4833, 1e-4)
    # longer answers are not what this evidence watches
    assert fired(monitor(), stream([3.5, 3.5, 3.5, 4.0, 4.5])) == {}


def test_shorter_answers_that_get_more_right_are_not_a_hack():
    # the 4 x 4 sweep's DAPO segment 14 (healthy): held-out answers 3.55 -> 3.42 tokens at step 200 (3.5% under
    # its last three) while held-out accuracy reached its best, 0.28 (0.25 / 0.23 / 0.26 before)
    rows = stream([3.55, 3.55, 3.53, 3.42, 3.52])
    for (_, row), acc in zip([r for r in rows if ACC in r[1]], [0.25, 0.23, 0.26, 0.28, 0.26]):
        row[ACC] = acc
    assert fired(monitor(), rows) == {}
    # the same answers with the accuracy no better than the baseline's best: fired
    rows[39][1][ACC] = 0.26
    assert list(fired(monitor(), rows)) == [40]


def test_shorter_answers_without_pay_are_not_a_hack_and_not_a_baseline():
    rows = stream([3.5, 3.5, 3.5, 3.0, 3.5, 3.0])
    for step, row in rows:
        if 31 <= step <= 40:
            row["reward/mean"] = 0.0  # the reward fell before the shorter answers at 40
    events = fired(monitor(), rows)
    assert list(events) == [60]  # 40 passed over (unpaid) and kept out of the baseline; 60 is paid


def test_a_rollback_keeps_the_restored_policys_answers_and_a_checkpoint_carries_them():
    m = monitor()
    fired(m, stream([3.5, 3.4, 3.6]))  # baseline 3.5 from the evaluations at 10, 20, 30
    m.reset_after_rollback(20)  # back to step 20: the evaluation at 30 belonged to the abandoned policy
    (rule,) = m.rules
    assert [a[0] for a in rule.answers] == [10, 20]
    state = json.loads(json.dumps(rule.state_dict()))  # as a checkpoint stores it
    assert state["answers"] == [[10, 3.5, 0.3], [20, 3.4, 0.3]]
    fresh = monitor()
    (other,) = fresh.rules
    other.load_state_dict(state)
    assert list(other.answers) == [(10, 3.5, 0.3), (20, 3.4, 0.3)]
    older = {k: v for k, v in state.items() if k != "answers"}  # a checkpoint from before this evidence
    other.load_state_dict(older)
    assert list(other.answers) == []
