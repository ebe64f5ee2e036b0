"""Durable before acknowledged, on the state machine and its spool (issue 16's reproductions):

- a spool write that fails (ENOSPC) leaves no trace: the push is answered ``unavailable``, its retry is
  *ingested* (not answered ``duplicate``), and nothing acknowledged is missing after a restart;
- a group that cannot be spooled (nested ~1,000 deep) is refused, not half-taken;
- recovery resynchronises after a damaged record (a flipped bit at 10 % of the file kept 10 of 100 groups
  before), quarantines the damaged bytes and rewrites the log.

The same over a real broker process with a real write limit is in test_abuse.py.
"""

from __future__ import annotations

import errno
import os

from fleetrl.broker.server import spool as sp
from fleetrl.broker.server.spool import Spool
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.broker.server.test_state import lease_batch, lease_prompts, push
from tests.helpers import make_group


class FullDisk:
    """os.write on the spool's descriptor fails with ENOSPC after ``room`` more bytes (a 1 MiB tmpfs, in effect)."""

    def __init__(self, monkeypatch, spool: Spool, room: int = 0):
        self.spool, self.room, self.full = spool, room, True
        real = os.write

        def write(fd, data):
            if fd != self.spool._fd or not self.full:
                return real(fd, data)
            if self.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real(fd, bytes(data)[: self.room])  # a partial write, as a filling disk does
            self.room -= n
            return n

        monkeypatch.setattr(sp.os, "write", write)


def reopen(path, *overrides: str):
    return make_state(
        "broker.commit_on_checkpoint=true",
        "broker.queue_capacity=1000",
        *overrides,
        spool=Spool(path, fsync="never"),
        n_prompts=200,
    )


def test_a_full_disk_is_unavailable_not_acknowledged_and_the_retry_is_ingested(tmp_path, monkeypatch):
    s = reopen(tmp_path)
    lease = lease_prompts(s, 8)
    groups = [make_group(p.prompt_id) for p in lease.prompts]
    acked = [g.group_id for g in groups[:3] if push(s, g).count == 1]
    disk = FullDisk(monkeypatch, s.spool, room=100)  # the next record is cut off half-way
    size = (tmp_path / "segment-00000001.log").stat().st_size
    for g in groups[3:]:
        reply = push(s, g)
        assert isinstance(reply, m.Error) and reply.code == "unavailable" and "ENOSPC" in reply.reason
    batch = s.handle(m.PushGroups(req_id=9, client_id="r0", groups=groups[3:]), 0.0)
    assert batch.code == "unavailable"
    assert (tmp_path / "segment-00000001.log").stat().st_size == size  # the partial record was cut off again
    assert set(s.groups) == set(acked) and s.prompts.leased == 5 and s.counters["duplicates"] == 0  # no trace
    assert lease_prompts(s, 1).code == "unavailable"  # a lease must be spooled too
    assert isinstance(s.handle(m.GetStatus(req_id=1), 0.0), m.Status)  # reads are served throughout
    assert s.status(0, 0.0).counters["spool_unavailable"] >= 6
    disk.full = False  # space returns: serving resumes by itself
    for g in groups[3:]:
        reply = push(s, g)
        assert reply.count == 1 and not reply.duplicate  # ingested, not "duplicate"
        acked.append(g.group_id)
    r = reopen(tmp_path)  # restart: every acknowledged group is there, once
    assert set(r.groups) == set(acked) and len(r.queue) == len(acked)


def test_leases_and_acks_that_cannot_be_spooled_change_nothing(tmp_path, monkeypatch):
    s = reopen(tmp_path)
    lease = lease_prompts(s, 4)
    for p in lease.prompts:
        push(s, make_group(p.prompt_id))
    batch = lease_batch(s, 4)
    cursor = (s.prompts.epoch, s.prompts.pos)
    disk = FullDisk(monkeypatch, s.spool)
    assert lease_prompts(s, 4).code == "unavailable" and (s.prompts.epoch, s.prompts.pos) == cursor
    ack = s.handle(m.AckBatch(req_id=1, client_id="l0", lease_id=batch.lease_id, step=1), 0.0)
    assert ack.code == "unavailable" and s.in_flight == 4 and not s.uncommitted
    assert s.handle(m.Commit(req_id=1, client_id="l0", step=1), 0.0).code == "unavailable"
    s.expire(10**6)  # lease expiry cannot be spooled either: retried on a later tick, nothing lost
    disk.full = False
    assert [p.prompt_id for p in lease_prompts(s, 4, now=10**6).prompts] == ["0:4", "0:5", "0:6", "0:7"]


def test_deeply_nested_metadata_is_refused_not_half_taken(state):
    lease = lease_prompts(state, 1)
    deep = 1
    for _ in range(990):
        deep = {"x": deep}
    g = make_group(lease.prompts[0].prompt_id)
    g.metadata = {"deep": deep}
    reply = push(state, g)
    assert reply.code == "invalid_group" and "nested deeper" in reply.reason
    again = push(state, g)  # the retry is refused again: never "duplicate" (acknowledged) for a group not held
    assert again.code == "invalid_group" and not state.groups and state.counters["duplicates"] == 0


def test_recovery_resynchronises_after_a_flipped_bit_and_quarantines_it(tmp_path):
    s = reopen(tmp_path)
    lease = lease_prompts(s, 100)
    prompt_of = {}
    for p in lease.prompts:
        g = make_group(p.prompt_id)
        prompt_of[g.group_id] = p.prompt_id
        assert push(s, g).count == 1
    s.spool.close()
    seg = tmp_path / "segment-00000001.log"
    data = bytearray(seg.read_bytes())
    at = len(data) // 10
    data[at] ^= 0x10  # one flipped bit at 10 % of the file
    seg.write_bytes(bytes(data))
    r = reopen(tmp_path)
    kept = set(r.groups)
    assert len(kept) >= 99, f"kept {len(kept)} of 100"  # only the damaged record is lost (before: 10 of 100)
    lost = {prompt_of[g] for g in set(prompt_of) - kept}
    assert lost <= {p.prompt_id for p in r.prompts.reissue}  # ... and its prompt is generated again
    # one record skipped: the largest here is the 100-prompt lease (~2.7 kB with its answers in metadata)
    assert r.recovery["regions_quarantined"] == 1 and 0 < r.recovery["bytes_skipped"] < 4096
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].stat().st_mode & 0o777 == 0o600
    assert bytes(data[at : at + 1]) in quarantined[0].read_bytes()
    r.spool.close()
    clean = reopen(tmp_path)  # the log was rewritten: the next replay finds nothing damaged
    assert set(clean.groups) == kept and clean.recovery["regions_quarantined"] == 0


def test_spool_files_are_owner_only(tmp_path):
    s = reopen(tmp_path / "spool")
    lease = lease_prompts(s, 1)
    push(s, make_group(lease.prompts[0].prompt_id))
    assert (tmp_path / "spool").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "spool").glob("segment-*.log"))


def test_scan_finds_every_record_around_garbage():
    recs = [sp.SeenIds([f"g{i}"]) for i in range(20)]
    blob = sp.encode_records(recs[:10]) + b"\x93\x01garbage\x00" * 7 + sp.encode_records(recs[10:])
    found, damaged = sp.scan(blob)
    assert [r.group_ids for r in found] == [r.group_ids for r in recs] and len(damaged) == 1
