"""The spool: a restarted broker rebuilds exactly the acknowledged, unconsumed state."""

from __future__ import annotations

from fleetrl.broker.spool import Spool
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.broker.test_state import ack, fill, lease_batch, lease_prompts, publish


def reopen(path, **kw):
    return make_state("broker.commit_on_checkpoint=true", spool=Spool(path, fsync="never", **kw))


def test_restart_recovers_queue_uncommitted_cursor_and_version(tmp_path):
    s = reopen(tmp_path)
    groups = fill(s, 4)
    batch = lease_batch(s, 2)
    ack(s, batch, step=1)
    publish(s, 1)
    lease_prompts(s, 2, version=1)  # out with a (soon dead) rollout server
    s.spool.flush()

    r = reopen(tmp_path)  # same directory: like a restart after SIGKILL
    assert set(r.groups) == {g.group_id for g in groups}
    assert [r.queue[i] for i in range(len(r.queue))] == [g.group_id for g in groups[2:]]
    assert r.uncommitted == {"l0": [(1, groups[0].group_id), (1, groups[1].group_id)]}
    assert r.version == 1 and (r.prompts.epoch, r.prompts.pos) == (0, 6)
    assert [p.prompt_id for p in lease_prompts(r, 3, version=1).prompts] == ["0:4", "0:5", "0:6"]  # open ones first
    from tests.helpers import make_group
    dup = r.handle(m.PushGroup(req_id=1, client_id="r0", group=make_group("0:0", gid=groups[0].group_id)), 0.0)
    assert dup.duplicate  # de-duplication survives the restart
    r.handle(m.Commit(req_id=1, client_id="l0", step=1), 0.0)
    r.spool.flush()
    assert set(reopen(tmp_path).groups) == {g.group_id for g in groups[2:]}


def test_torn_tail_is_cut(tmp_path):
    s = reopen(tmp_path)
    groups = fill(s, 2)
    s.spool.flush()
    seg = sorted(tmp_path.glob("segment-*.log"))[-1]
    with seg.open("ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")  # a record header whose body never made it
    r = reopen(tmp_path)
    assert set(r.groups) == {g.group_id for g in groups}
    fill(r, 1)
    r.spool.flush()
    assert len(reopen(tmp_path).groups) == 3  # appends after the cut are readable


def test_compaction_keeps_live_state_and_drops_old_segments(tmp_path):
    s = reopen(tmp_path, segment_bytes=2000)
    for step in range(1, 6):
        fill(s, 4)
        ack(s, lease_batch(s, 4), step=step)
        s.handle(m.Commit(req_id=1, client_id="l0", step=step), 0.0)
    live = fill(s, 2)
    ack(s, lease_batch(s, 1), step=6)
    s.spool.flush()
    assert s.spool.needs_compaction()
    s.spool.compact(s.snapshot())
    assert len(list(tmp_path.glob("segment-*.log"))) == 1
    r = reopen(tmp_path)
    assert set(r.groups) == {g.group_id for g in live}
    assert r.uncommitted == {"l0": [(6, live[0].group_id)]} and list(r.queue) == [live[1].group_id]
    assert (r.prompts.epoch, r.prompts.pos) == (s.prompts.epoch, s.prompts.pos)
