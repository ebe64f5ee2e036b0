"""A rollback's discard at the broker: every group with a token from a discarded version goes, queued or
late, including groups whose oldest token (their policy_version) is older; rewound groups too."""

from __future__ import annotations

import numpy as np

from fleetrl.broker.inproc import InprocBroker
from fleetrl.broker.queue import VersionRanges
from fleetrl.common import messages as m
from tests.broker.conftest import make_state


def group(gid: str, n: int, oldest: int, newest: int) -> m.SampleGroup:
    rng = np.random.default_rng(n)
    versions = [np.array([oldest, newest], dtype=np.int32), np.array([oldest, oldest], dtype=np.int32)]
    return m.build_group(gid, f"0:{n}", oldest, rng.integers(7, 90, 4), [(rng.integers(7, 90, 2), np.full(2, -1.0))] * 2,
                         [1.0, 0.0], token_versions=versions)


def test_version_ranges_touch_any_token():
    r = VersionRanges([(4, 6)])
    assert r.overlaps(6, 9) and r.overlaps(1, 4) and not r.overlaps(7, 9) and not r.overlaps(0, 3)
    assert r.touches(group("a", 1, 3, 4))  # started healthy on 3, finished on discarded 4
    assert not r.touches(group("b", 2, 2, 3)) and r.touches(group("c", 3, 5, 5))
    assert not VersionRanges().touches(group("d", 4, 5, 5))


def test_discard_drops_queued_late_and_rewound_groups():
    state = make_state("broker.accept_unleased=true", "broker.max_staleness=100", "broker.commit_on_checkpoint=true",
                       n_prompts=50, vocab_size=100)
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
