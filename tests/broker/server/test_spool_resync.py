"""Spool recovery is linear in crafted candidate headers (issue 31, item 7 of its list): after damage the reader
looks for the next valid record, and a record whose bytes hold headers that each claim megabytes made that
quadratic: 20 s for a 2 MiB record, 81 s for 4 MiB, hours for 64 MiB. Each candidate's CRC now comes from two
prefix CRCs (broker/server/resync.py); these check that arithmetic against zlib and recover crafted records.

Times are process CPU seconds (the box is shared; wall time would measure the neighbours)."""

from __future__ import annotations

import struct
import time
import zlib

import numpy as np
import pytest

from fleetrl.broker.server import resync
from fleetrl.broker.server import spool as sp
from tests.helpers import make_group

MIB = 1 << 20


def test_range_crcs_and_shifts_agree_with_zlib():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    starts = rng.integers(0, len(data), 3000)
    ends = np.minimum(starts + rng.integers(0, 200_000, 3000), len(data))
    got = resync.range_crcs(data, starts, ends)
    assert [int(x) for x in got] == [zlib.crc32(data[s:e]) for s, e in zip(starts.tolist(), ends.tolist())]
    points = np.unique(rng.integers(100, len(data), 50_000))  # dense: the block pass, against zlib one by one
    assert np.array_equal(resync.prefix_by_blocks(data, 100, points), resync.prefix_by_walk(data, 100, points))
    v = rng.integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)
    n = rng.integers(0, 1 << 21, 200)
    want = [zlib.crc32(bytes(k), x) ^ zlib.crc32(bytes(k)) for x, k in zip(v.tolist(), n.tolist())]
    assert [int(x) for x in resync.shift(v, n)] == want


def crafted_segment(size: int, every: int = 32) -> tuple[bytes, list[str]]:
    """Record A, a record of ``size`` bytes whose body is candidate headers every ``every`` bytes (each claims the
    rest of the segment, with a wrong CRC) and whose own header is damaged, then records B and C."""
    groups = [make_group("0:0", gid=name) for name in "ABC"]
    a, b, c = (sp.encode_records([sp.GroupAccepted(g)]) for g in groups)
    total = len(a) + 8 + size + len(b) + len(c)
    body = bytearray(size)
    start = len(a) + 8
    for off in range(0, size - every, every):
        claim = total - (start + off + 8) - 1  # ends one byte before the end of the segment: it fits
        body[off : off + 10] = struct.pack("<II", claim, 0xDEADBEEF) + b"\x92\x01"
    header = struct.pack("<II", 1 << 31, zlib.crc32(body))  # damaged: a length that cannot be
    return a + header + bytes(body) + b + c, ["A", "B", "C"]


def recover(data: bytes) -> tuple[list[str], list[tuple[int, int]], float]:
    t0 = time.process_time()
    records, damaged = sp.scan(data)
    return [r.group.group_id for r in records], damaged, time.process_time() - t0


def test_a_crafted_record_is_skipped_in_linear_time():
    resync.shift_tables()  # built once per process (~0.3 s), not part of a recovery
    data, names = crafted_segment(2 * MIB)  # was 20 s
    got, damaged, took = recover(data)
    assert got == names and len(damaged) == 1
    assert took < 2.0, took
    dense, names = crafted_segment(MIB, every=10)  # a candidate every 10 bytes
    got, _, _ = recover(dense)
    assert got == names


@pytest.mark.slow
def test_a_crafted_64_mib_record_is_recovered_in_under_5_s(tmp_path):
    resync.shift_tables()
    data, names = crafted_segment(64 * MIB)  # quadratic before: hours
    seg = tmp_path / "spool"
    seg.mkdir()
    (seg / "segment-00000001.log").write_bytes(data)
    t0 = time.process_time()
    rec = sp.Spool(seg).recover()
    took = time.process_time() - t0
    assert list(rec.groups) == names and rec.damaged == 1 and rec.skipped_bytes == 64 * MIB + 8
    assert took < 5.0, took
