"""A rollback's discard at the broker: every group with a token from a discarded version goes, queued or
late, including groups whose oldest token (their policy_version) is older; rewound groups too."""

from __future__ import annotations

import numpy as np
import pytest

from fleetrl.broker.client.errors import BrokerError
from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.broker.server.queue import VersionRanges
from fleetrl.broker.server.spool import Spool
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.helpers import make_group


def group(gid: str, n: int, oldest: int, newest: int) -> m.SampleGroup:
    rng = np.random.default_rng(n)
    versions = [np.array([oldest, newest], dtype=np.int32), np.array([oldest, oldest], dtype=np.int32)]
    return m.build_group(
        gid,
        f"0:{n}",
        oldest,
        rng.integers(7, 90, 4),
        [(rng.integers(7, 90, 2), np.full(2, -1.0))] * 2,
        [1.0, 0.0],
        token_versions=versions,
    )


def test_version_ranges_touch_any_token():
    r = VersionRanges([(4, 6)])
    assert r.overlaps(6, 9) and r.overlaps(1, 4) and not r.overlaps(7, 9) and not r.overlaps(0, 3)
    assert r.touches(group("a", 1, 3, 4))  # started healthy on 3, finished on discarded 4
    assert not r.touches(group("b", 2, 2, 3)) and r.touches(group("c", 3, 5, 5))
    assert not VersionRanges().touches(group("d", 4, 5, 5))


def test_discard_drops_queued_late_and_rewound_groups():
    state = make_state(
        "broker.accept_unleased=true",
        "broker.max_staleness=100",
        "broker.commit_on_checkpoint=true",
        n_prompts=50,
        vocab_size=100,
    )
    broker = InprocBroker(state)
    rollout, learner = broker.client("r0", "rollout"), broker.client("learner-0", "learner")
    rollout.connect(), learner.connect()
    for v in range(1, 8):
        assert learner.publish_version(v, v, m.WeightsInfo()).ref == str(v)
    trained = group("trained", 1, 4, 5)  # trained at step 5 on the branch about to be abandoned
    assert rollout.push_groups([trained])[0].status == "accepted"
    lease = learner.lease_batch(1)
    learner.ack_batch(lease.lease_id, ["trained"], step=5)
    rollout.push_groups([group("old", 2, 2, 3), group("spans", 3, 3, 4), group("bad", 4, 6, 6)])
    assert learner.rewind(3).count == 1  # rolled back to the checkpoint of step 3: "trained" comes back
    ack = learner.control("discard", reason="rollback", min_version=4, max_version=7)
    assert ack.count == 3  # trained (rewound), spans (oldest 3, a token from 4) and bad
    learner.publish_version(8, 8, m.WeightsInfo())
    late = rollout.push_groups([group("late", 5, 3, 5), group("fresh", 6, 8, 8)])
    assert [a.status for a in late] == ["stale", "accepted"]
    left = learner.lease_batch(10)
    assert sorted(g.group_id for g in left.groups) == ["fresh", "old"]
    assert state.counters["discarded"] >= 3


def test_an_operator_discard_covers_only_published_versions():
    """Issue 31: Control(discard, 0, 2**31-1) was accepted and every later fresh group was `stale`, even after a
    restart. A discard now ends at the current version at most, for an operator too."""
    state = make_state("broker.accept_unleased=true", "broker.max_staleness=100", n_prompts=50, vocab_size=100)
    broker = InprocBroker(state)
    rollout, learner, operator = (
        broker.client(c, r) for c, r in [("r0", "rollout"), ("learner-0", "learner"), ("op-0", "operator")]
    )
    for c in (rollout, learner, operator):
        c.connect()
    for v in range(1, 4):
        learner.publish_version(v, v, m.WeightsInfo())
    with pytest.raises(BrokerError) as e:
        operator.control("discard", reason="oops", min_version=0, max_version=2**31 - 1)
    assert (
        e.value.code == "bad_request"
        and "past the current version 3" in str(e.value)
        and "--max-version 3" in str(e.value)
    )
    assert state.discarded_versions == []
    assert operator.control("discard", reason="bad run", min_version=2, max_version=3).count == 0
    learner.publish_version(4, 4, m.WeightsInfo())
    acks = rollout.push_groups([group("fresh", 1, 4, 4), group("late", 2, 3, 3)])
    assert [a.status for a in acks] == ["accepted", "stale"]


def test_an_operators_resume_lifts_what_it_discarded_during_its_pause(tmp_path):
    """Issue 31: `resume` did not undo a pause-with-discard. Now the operator's resume lifts the ranges it
    discarded while paused (also after a restart: the spool keeps what remains); a range discarded outside
    the pause, and a learner's rollback discard during it, stay."""
    spool_dir = tmp_path / "spool"

    def start():
        state = make_state(
            "broker.accept_unleased=true",
            "broker.max_staleness=100",
            n_prompts=50,
            vocab_size=100,
            spool=Spool(spool_dir, fsync="never"),
        )
        broker = InprocBroker(state)
        clients = [broker.client(c, r) for c, r in [("r0", "rollout"), ("learner-0", "learner"), ("op-0", "operator")]]
        for c in clients:
            c.connect()
        return state, clients

    state, (rollout, learner, operator) = start()
    for v in range(1, 11):
        learner.publish_version(v, v, m.WeightsInfo())
    operator.control("discard", reason="for good", min_version=1, max_version=1)  # no pause: stays
    assert rollout.push_groups([group("queued", 1, 5, 5)])[0].status == "accepted"
    operator.control("pause", reason="maintenance")
    assert operator.control("discard", reason="purge", min_version=4, max_version=6).count == 1  # the queued one goes
    learner.control("pause", reason="rollback")
    learner.control("discard", reason="rollback", min_version=9, max_version=10)
    learner.control("resume", reason="rollback done")
    assert state.discarded_versions == [(1, 1), (4, 6), (9, 10)]
    operator.control("resume", reason="done")
    assert state.discarded_versions == [(1, 1), (9, 10)]
    acks = rollout.push_groups([group("a", 2, 5, 5), group("b", 3, 1, 1), group("c", 4, 9, 9)])
    assert [a.status for a in acks] == ["accepted", "stale", "stale"]
    state.spool.flush()

    state, (rollout, learner, operator) = start()  # a restart replays the lifted set
    assert state.discarded_versions == [(1, 1), (9, 10)]
    state.spool.compact(state.snapshot())
    state, _ = start()
    assert state.discarded_versions == [(1, 1), (9, 10)]


def test_one_leased_prompt_takes_only_group_size_samples_per_hand_out():
    """Issue 31: one leased prompt id accepted 10,000 groups against a capacity of 48 and the learner's next
    batch was all junk. Now a prompt takes rollout.group_size samples each time it is handed out: a re-issued
    prompt may be answered by its late first holder and by the next, and no more."""
    state = make_state("rollout.group_size=2", "broker.max_staleness=100", n_prompts=50, vocab_size=100)
    broker = InprocBroker(state)
    rollout, other = broker.client("r0", "rollout"), broker.client("r1", "rollout")
    rollout.connect(), other.connect()
    (p, q) = rollout.lease_prompts(2, 0).prompts
    flood = [make_group(p.prompt_id, gid=f"junk-{i}") for i in range(200)]  # 2 samples each
    acks = rollout.push_groups(flood)
    assert [a.status for a in acks].count("accepted") == 1 and len(state.q.groups) == 1
    refused = next(a for a in acks if a.status == "rejected")
    assert "rollout.group_size" in refused.reason and state.rejected["prompt_overanswered"] == 199
    assert rollout.push_groups([make_group(q.prompt_id, gid="real")])[0].status == "accepted"  # others unaffected
    state.prompts.requeue(p)  # re-issued (e.g. its lease expired): one more group's worth
    assert other.lease_prompts(1, 0).prompts[0].prompt_id == p.prompt_id
    assert [a.status for a in other.push_groups([make_group(p.prompt_id, gid=f"again-{i}") for i in range(3)])] == [
        "accepted",
        "rejected",
        "rejected",
    ]
