"""Quarantine at the broker (control ``quarantine`` / ``release``): one rollout server gets no prompts, its
queued and later groups are dropped and their prompts go to the others; the rest of the fleet goes on."""

from __future__ import annotations

import numpy as np
import pytest

from fleetrl.broker.client.errors import BrokerError
from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.common import messages as m
from tests.broker.conftest import make_state


def group(gid: str, prompt: str, server: str) -> m.SampleGroup:
    rng = np.random.default_rng(len(gid))
    return m.build_group(
        gid,
        prompt,
        0,
        rng.integers(7, 90, 4),
        [(rng.integers(7, 90, 2), np.full(2, -1.0))] * 2,
        [1.0, 0.0],
        server_id=server,
    )


@pytest.fixture
def fleet():
    state = make_state("broker.max_staleness=100", n_prompts=50, vocab_size=100)
    broker = InprocBroker(state)
    good, bad, learner = (
        broker.client("good", "rollout"),
        broker.client("bad", "rollout"),
        broker.client("learner-0", "learner"),
    )
    for c in (good, bad, learner):
        c.connect()
    return state, good, bad, learner, broker


def test_a_quarantined_server_gets_no_prompts_and_its_groups_are_dropped(fleet):
    state, good, bad, learner, _ = fleet
    lease_good, lease_bad = good.lease_prompts(2, 0), bad.lease_prompts(3, 0)
    pg, pb = [p.prompt_id for p in lease_good.prompts], [p.prompt_id for p in lease_bad.prompts]
    assert bad.push_groups([group("b0", pb[0], "bad")])[0].status == "accepted"
    ack = learner.control("quarantine", reason="server_poison fired", target="bad")
    assert ack.count == 1  # its queued group went
    assert state.status(1, 0.0).quarantined == {"bad": "server_poison fired"}
    # its leases are throttled, with the reason and the way out
    reply = bad.lease_prompts(2, 0)
    assert isinstance(reply, m.Throttle) and "quarantined: server_poison fired" in reply.reason
    assert "fleetrl control release --target bad" in reply.reason
    # what it pushes now (even under another server's name) is dropped; the others' groups are taken
    late = bad.push_groups([group("b1", pb[1], "bad"), group("b2", pb[2], "good")])
    assert [a.status for a in late] == ["stale", "stale"] and "quarantined" in late[0].reason
    assert good.push_groups([group("g0", pg[0], "good")])[0].status == "accepted"
    assert [g.group_id for g in learner.lease_batch(10).groups] == ["g0"]
    assert state.counters["quarantined"] == 3
    # its prompts were issued again: the good server gets them
    again = {p.prompt_id for p in good.lease_prompts(50, 0).prompts}
    assert set(pb) <= again


def test_release_lifts_it_and_only_an_operator_may(fleet):
    state, good, bad, learner, broker = fleet
    learner.control("quarantine", reason="poison", target="bad")
    with pytest.raises(BrokerError, match="Control\\(release\\) needs role operator"):
        learner.control("release", target="bad")
    with pytest.raises(BrokerError, match="names the rollout server in target"):
        learner.control("quarantine", reason="no target")
    operator = broker.client("operator-0", "operator")
    operator.connect()
    operator.control("release", target="bad")
    assert state.status(1, 0.0).quarantined == {}
    assert isinstance(bad.lease_prompts(1, 0), m.PromptLease)


def test_a_rollout_may_not_quarantine_another():
    state = make_state(n_prompts=10, vocab_size=100)
    broker = InprocBroker(state)
    rollout = broker.client("r0", "rollout")
    rollout.connect()
    with pytest.raises(BrokerError, match="unauthorized|needs role"):
        rollout.control("quarantine", target="r1")
    assert state.controls.quarantined == {}
