"""The rollout finisher's push: a group the broker refuses costs only itself, and its prompt goes back at once."""

from __future__ import annotations

from fleetrl.broker.client.errors import BrokerError
from fleetrl.common import messages as m
from fleetrl.rollout.loop import Finisher, MetricsFile, OpenLeases, Stats
from tests.helpers import make_group


class FramesClient:
    """Refuses a whole frame holding a group in ``bad`` (as the broker does with an undecodable group);
    acks the groups of any other frame with ``status``."""

    def __init__(self, bad: set[str], status: dict[str, str] | None = None):
        self.bad, self.status, self.frames = bad, status or {}, []

    def push_groups(self, groups, deadline_s=None):
        self.frames.append([g.group_id for g in groups])
        if any(g.group_id in self.bad for g in groups):
            raise BrokerError("bad_frame", "a group could not be decoded")
        return [m.GroupAck(group_id=g.group_id, status=self.status.get(g.group_id, "accepted")) for g in groups]


def finisher(client) -> Finisher:
    f = Finisher(
        client,
        scorer=None,
        server_id="r",
        leases=OpenLeases(),
        stats=Stats(),
        metrics=MetricsFile(None),
        push_deadline_s=5.0,
        extra_metrics=dict,
    )
    f.abandon()
    return f


def groups(n: int) -> list[m.SampleGroup]:
    return [make_group(f"p{i}", gid=f"g{i}") for i in range(n)]


def test_one_refused_group_does_not_sink_the_frame():
    client, refused = FramesClient(bad={"g2"}), []
    counts = finisher(client).push(groups(4), refused)
    assert counts == {"groups_pushed": 3, "groups_stale": 0, "groups_rejected": 1}
    assert client.frames[0] == ["g0", "g1", "g2", "g3"] and sorted(client.frames[1:]) == [
        ["g0"],
        ["g1"],
        ["g2"],
        ["g3"],
    ]
    assert refused == ["p2"]


def test_a_valid_frame_goes_in_one_push_and_rejected_acks_return_their_prompts():
    client, refused = FramesClient(bad=set(), status={"g1": "rejected", "g3": "stale"}), []
    counts = finisher(client).push(groups(4), refused)
    assert len(client.frames) == 1
    assert counts == {"groups_pushed": 2, "groups_stale": 1, "groups_rejected": 1} and refused == ["p1"]


def test_a_single_refused_group_is_counted_not_raised():
    client, refused = FramesClient(bad={"g0"}), []
    assert finisher(client).push(groups(1), refused) == {"groups_rejected": 1} and refused == ["p0"]
