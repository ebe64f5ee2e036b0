"""The status line's short form of events.jsonl: a rollback names the rule that asked for it (issue 30, item 9)."""

from __future__ import annotations

from fleetrl.app.launch.status import describe_event


def test_a_rollback_names_the_rule_that_asked_for_it():
    cause = {"step": 25, "rule": "kl_spike", "action": "rollback", "metric": "actor/kl"}
    rollback = {
        "step": 25,
        "rule": "rollback",
        "action": "rollback",
        "metric": "health/rollbacks",
        "value": 1.0,
        "threshold": 3.0,
    }
    assert describe_event(cause) == "kl_spike -> rollback @ 25"
    assert describe_event(rollback, cause) == "rolled back @ 25 (kl_spike on actor/kl), rollback 1/3"
    assert "rollback -> rollback" not in describe_event(rollback)
