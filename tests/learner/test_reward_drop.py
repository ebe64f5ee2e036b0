"""reward_drop's default: quiet on recorded healthy small-batch runs, divergence still caught (issue 27)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetrl.common.config.learner import HealthConfig, HealthRule
from fleetrl.learner.health import HealthMonitor

# reward/mean of recorded runs: 12 healthy 250-step segments of the 4 x 4 false-alarm sweep (every one the old
# default rolled back at least once) and the three divergence runs (lr x 50 from step 45) up to their recorded
# rollback; benchmarks/health_streams.py and benchmarks/health_recovery.py recorded them
STREAMS = json.loads((Path(__file__).parent / "data" / "reward_drop_streams.json").read_text())
OLD = HealthRule(name="reward_drop", action="rollback", window=10, threshold=0.2)


def default_reward_drop() -> HealthRule:
    (rule,) = [r for r in HealthConfig().rules if r.name == "reward_drop"]
    return rule


def replay(rule: HealthRule, rows) -> list[int]:
    """Steps the rule fires at, its windows reset after each rollback as the learner's would be."""
    m = HealthMonitor(HealthConfig(rules=[rule]), None)
    fired = []
    for step, reward in rows:
        if m.observe(step, {"reward/mean": reward}):
            fired.append(step)
            m.reset_after_rollback(step)
    return fired


def test_the_default_is_quiet_on_healthy_small_batch_runs_the_old_one_rolled_back():
    old = {name: replay(OLD, rows) for name, rows in STREAMS["healthy"].items()}
    assert sum(map(len, old.values())) == 15 and all(old.values())  # 15 false rollbacks in 3,000 steps
    new = {name: replay(default_reward_drop(), rows) for name, rows in STREAMS["healthy"].items()}
    assert new == {name: [] for name in STREAMS["healthy"]}


@pytest.mark.parametrize("name", ["divergence-s1", "divergence-s2", "divergence-s3"])
def test_the_default_still_catches_divergence_no_later_than_the_old_one(name):
    run = STREAMS["divergence"][name]
    assert replay(OLD, run["rows"]) == [run["recorded_rollback"]]  # what the live run did
    (first,) = replay(default_reward_drop(), run["rows"])
    assert run["injected"] < first <= run["recorded_rollback"] and first - run["injected"] <= 20


def feed(rule: HealthRule, values) -> dict[int, list]:
    m = HealthMonitor(HealthConfig(rules=[rule]), None)
    return {s: e for s, v in enumerate(values, 1) if (e := m.observe(s, {"reward/mean": v}))}


def test_persist_needs_that_many_steps_in_a_row_under_the_limit():
    rule = HealthRule(name="reward_drop", action="rollback", window=4, threshold=0.25, persist=3)
    # best 4-step average 0.75; limit 0.5: two bad steps, one good, then three bad -> fires on the third
    fired = feed(rule, [0.75] * 6 + [0.2, 0.2, 0.75, 0.2, 0.3, 0.4])
    assert list(fired) == [12]
    (e,) = fired[12]
    assert (e.value, e.threshold) == (0.4, 0.5)  # the highest of the three, under 0.75 - 0.25
    assert "for 3 steps" in e.message and "below its best 0.75" in e.message
    # the same dip as a 4-step average (persist null, the older form) fires at once on a 2-step dip
    assert list(feed(HealthRule(name="reward_drop", window=4, threshold=0.25), [0.75] * 6 + [0.2, 0.2])) == [8]


def test_persist_is_refused_on_other_rules_and_survives_a_checkpoint():
    with pytest.raises(ValueError, match=r"health.rules\[0\].persist=5 \(length_collapse\).*only reward_drop"):
        HealthMonitor(HealthConfig(rules=[HealthRule(name="length_collapse", persist=5)]), None)
    rule = HealthRule(name="reward_drop", action="rollback", window=4, threshold=0.25, persist=3)
    a = HealthMonitor(HealthConfig(rules=[rule]), None)
    for s, v in enumerate([0.75] * 6 + [0.2, 0.2], 1):
        a.observe(s, {"reward/mean": v})
    b = HealthMonitor(HealthConfig(rules=[rule]), None)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.observe(9, {"reward/mean": 0.2})  # the two bad steps before the checkpoint count
    state = a.state_dict()  # a checkpoint from before `recent` existed: that window starts empty
    del state["rules"][0][1]["recent"]
    c = HealthMonitor(HealthConfig(rules=[rule]), None)
    c.load_state_dict(state)
    assert not c.observe(9, {"reward/mean": 0.2})


def test_persist_from_yaml_and_a_bad_value_names_the_key():
    from fleetrl.common.config import ConfigError, load_config

    cfg = load_config(None, ["health.rules=[{name: reward_drop, action: rollback, window: 30, persist: 5}]"])
    assert cfg.health.rules[0].persist == 5
    with pytest.raises(ConfigError, match="persist"):
        load_config(None, ["health.rules=[{name: reward_drop, persist: 0}]"])
