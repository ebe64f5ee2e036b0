"""A rank waiting for groups tells an idle fleet from a fleet whose every group the broker refuses.

Before: a policy collapsed to log-probs of exactly 0.0 at temperature > 0 (issue 27's entropy-collapse fault,
seed 3) had every group refused at ingest (broker.max_zero_logprob_fraction); the learner waited 600 s and
died with "no groups arrived ... check that rollout servers run", which sent the operator to the wrong place."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.common.config.learner import HealthConfig
from fleetrl.learner.health import HealthMonitor
from fleetrl.learner.source import BrokerBatchSource, FleetIdle


class Broker:
    """A learner client whose leases always come back empty; ``status`` counts refusals at ``per_call``."""

    def __init__(self, per_call: int):
        self.per_call, self.refused, self.leases = per_call, 0, 0

    def lease_batch(self, n: int, wait_s: float = 0.0, min_groups: int = 1):
        self.leases += 1
        time.sleep(0.01)
        return m.Throttle(req_id=0, retry_after_s=0.05, reason="no groups")

    def status(self):
        self.refused += self.per_call
        return SimpleNamespace(counters={"implausible/logprob": self.refused, "refused/lease": 5})


def source(client, wait_s: float = 1.0) -> BrokerBatchSource:
    return BrokerBatchSource(client, load_config(None, [f"learner.batch_wait_s={wait_s}"]), 0, 1)


def test_an_idle_error_names_the_groups_the_broker_refused_meanwhile(caplog):
    client = Broker(per_call=7)
    with caplog.at_level(logging.WARNING, logger="fleetrl.learner.source"), pytest.raises(FleetIdle) as e:
        source(client).next(1)
    text = str(e.value)
    assert "learner.batch_wait_s=1" in text and "refused" in text and "implausible/logprob" in text, text
    assert "max_zero_logprob_fraction" in text
    assert "refused/lease" not in text  # only ingest refusals are the rollouts' groups
    assert any("implausible/logprob" in r.getMessage() for r in caplog.records)  # warned before giving up


def test_a_truly_idle_fleet_keeps_the_plain_message():
    with pytest.raises(FleetIdle) as e:
        source(Broker(per_call=0)).next(1)
    assert "refused" not in str(e.value) and "check that rollout servers run" in str(e.value)


def test_a_broker_whose_status_fails_still_gives_the_idle_error():
    client = Broker(per_call=3)
    client.status = lambda: (_ for _ in ()).throw(TimeoutError("status timed out"))
    with pytest.raises(FleetIdle, match="no groups arrived"):
        source(client).next(1)


def wait_with_health(tmp_path, per_call: int, step: int) -> tuple[HealthMonitor, list[dict]]:
    """A rank waits for ``step`` until FleetIdle with the trainer's hook set; the monitor and its events.jsonl rows."""
    health = HealthMonitor(HealthConfig(), tmp_path / "events.jsonl")
    src = source(Broker(per_call=per_call))
    src.on_refused = lambda refused, why: health.note_refused(step, refused, why)
    with pytest.raises(FleetIdle):
        src.next(step)
    path = tmp_path / "events.jsonl"
    return health, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_refusals_reach_events_jsonl_as_a_fleet_refused_alert(tmp_path):
    # no step trains while the fleet's every group is refused, so no rule runs: the wait itself writes the event
    health, rows = wait_with_health(tmp_path, per_call=7, step=12)
    assert rows and {r["rule"] for r in rows} == {"fleet_refused"} and {r["action"] for r in rows} == {"alert"}
    assert rows[0]["step"] == 12 and rows[0]["value"] >= 7 and rows[0]["metric"] == "broker/implausible"
    assert rows[0]["message"].startswith("no groups for ") and "implausible/logprob" in rows[0]["message"]
    assert health.last_bad is None and health.on_checkpoint(10)  # an alert that decides nothing


def test_an_idle_fleet_writes_no_event(tmp_path):
    assert wait_with_health(tmp_path, per_call=0, step=3)[1] == []


def test_a_warning_reads_the_brokers_counters_once(tmp_path):
    # each status call counts 7 more refusals here, so a second read would make the alert's value disagree with
    # its own message (it did: the count came from one status call, the text from another)
    _, rows = wait_with_health(tmp_path, per_call=7, step=5)
    assert rows
    for row in rows:
        assert f"refused {int(row['value'])} groups" in row["message"], row
