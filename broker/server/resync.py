"""Finding the next valid spool record after damage, in time linear in the bytes and the candidates (issue 31).

After a damaged record the reader looks for the first later offset that holds a valid record: a header
``<u32 length><u32 crc32>`` whose body opens with a msgpack array and a known tag, fits the segment, has
that CRC and decodes. Checking the CRC of each candidate one by one costs its length, and a group's own
bytes can be crafted into candidate headers that each claim megabytes: 20 s for a 2 MiB record, 81 s for
4 MiB, hours for 64 MiB. Here every candidate's CRC comes from two prefix CRCs instead:

    crc32(data[s:e]) == P(e) ^ S^(e - s)(P(s)),   P(t) = crc32(data[o:t]) for a fixed origin o <= s,

where ``S`` is one zero byte through the CRC register (linear over GF(2)); ``S^n`` is applied to all
candidates at once with byte tables of ``S^(b * 256^k)`` (4 x 256 operators, built once). The prefix CRCs
come from one zlib call per sorted start and end, or, when the candidates are dense, from one pass of
numpy over blocks of the data. Candidates are found with numpy and checked a million at a time; only
those whose CRC matches are decoded, in order, and the first that decodes wins.

Cost: about a microsecond per candidate header (less when dense) plus one CRC pass over the rest of the
segment per million candidates (a 64 MiB record of crafted headers: ``benchmarks/abuse.py`` and
``tests/broker/server/test_spool_resync.py``). What stays linear only per candidate: a candidate whose CRC
*matches* (a forger can compute them) is decoded, which costs its size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

BATCH = 1 << 20  # candidates checked together
BLOCK = 4096  # bytes a block of the dense prefix pass holds
DENSE = 64  # points closer than this many bytes apart on average: the block pass beats one zlib call each
SLICE = 8 << 20  # bytes of candidate offsets looked at together (bounds numpy's temporaries)
_TABLES: np.ndarray | None = None


def crc_table() -> np.ndarray:
    """The reflected CRC-32 table zlib uses (polynomial 0xEDB88320)."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(0xEDB88320), t >> 1)
    return t


def _apply(cols: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A GF(2)-linear map given by the images of the 32 unit vectors (``cols``), applied to every ``v``."""
    out = np.zeros_like(v)
    for i in range(32):
        out ^= np.where((v >> np.uint32(i)) & np.uint32(1), cols[i], np.uint32(0))
    return out


def shift_tables() -> np.ndarray:
    """``T[k, b, j, x]`` = S^(b * 256^k) applied to ``x << 8j``: four lookups per byte of a shift's length."""
    global _TABLES
    if _TABLES is None:
        t = crc_table()
        unit = np.uint32(1) << np.arange(32, dtype=np.uint32)
        base = t[unit & np.uint32(0xFF)] ^ (unit >> np.uint32(8))  # S: one zero byte
        byte_in = np.arange(256, dtype=np.uint32)[None, :] << (np.uint32(8) * np.arange(4, dtype=np.uint32)[:, None])
        tables = np.empty((4, 256, 4, 256), dtype=np.uint32)
        for k in range(4):
            op = unit.copy()  # identity
            for b in range(256):
                tables[k, b] = _apply(op, byte_in)
                op = _apply(base, op)  # S^(256^k) after op
            for _ in range(8):  # base^256 = S^(256^(k+1))
                base = _apply(base, base)
        _TABLES = tables
    return _TABLES


def shift(v: np.ndarray, n: np.ndarray) -> np.ndarray:
    """S^n(v) for every pair (``n`` < 2^32 bytes)."""
    tables = shift_tables()
    for k in range(4):
        b = ((n >> (8 * k)) & 0xFF).astype(np.intp)
        t = tables[k]
        v = t[b, 0, v & 0xFF] ^ t[b, 1, (v >> 8) & 0xFF] ^ t[b, 2, (v >> 16) & 0xFF] ^ t[b, 3, v >> 24]
    return v


def range_crcs(data: bytes | memoryview, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """crc32(data[s:e]) for every pair, from prefix CRCs taken from min(starts)."""
    origin = int(starts.min())
    points, inverse = np.unique(np.concatenate([starts, ends]), return_inverse=True)
    dense = len(points) * DENSE > int(points[-1]) - origin
    prefix = (prefix_by_blocks if dense else prefix_by_walk)(data, origin, points)
    p_start, p_end = prefix[inverse[: len(starts)]], prefix[inverse[len(starts) :]]
    return p_end ^ shift(p_start, (ends - starts).astype(np.int64))


def prefix_by_walk(data: bytes | memoryview, origin: int, points: np.ndarray) -> np.ndarray:
    """crc32(data[origin:p]) for sorted ``points``: one zlib call per point (sparse points)."""
    view, out = memoryview(data), np.empty(len(points), dtype=np.uint32)
    crc, at = 0, origin
    for i, p in enumerate(points.tolist()):
        crc = zlib.crc32(view[at:p], crc)
        out[i] = crc
        at = p
    return out


def prefix_by_blocks(data: bytes | memoryview, origin: int, points: np.ndarray) -> np.ndarray:
    """The same for dense points: every block of ``BLOCK`` bytes is run through the CRC table at once (one numpy
    step per byte offset within a block), its start state from zlib; each point's state is read as it passes."""
    table = crc_table()
    span = int(points[-1]) - origin
    nblocks = span // BLOCK + 1
    padded = np.zeros(nblocks * BLOCK, dtype=np.uint8)
    padded[:span] = np.frombuffer(data, dtype=np.uint8, count=span, offset=origin)
    columns = np.ascontiguousarray(padded.reshape(nblocks, BLOCK).T)  # columns[j] = byte j of every block
    view, starts, crc = padded.data, np.empty(nblocks, dtype=np.uint32), 0
    for k in range(nblocks):
        starts[k] = crc
        crc = zlib.crc32(view[k * BLOCK : (k + 1) * BLOCK], crc)
    rel = points - origin
    order = np.argsort(rel % BLOCK, kind="stable")
    bounds = np.searchsorted((rel % BLOCK)[order], np.arange(BLOCK + 1))
    out = np.empty(len(points), dtype=np.uint32)
    reg = starts ^ np.uint32(0xFFFFFFFF)  # zlib's register: the CRC before its final inversion
    for j in range(BLOCK):
        lo, hi = bounds[j], bounds[j + 1]
        if lo < hi:
            idx = order[lo:hi]
            out[idx] = reg[rel[idx] // BLOCK] ^ np.uint32(0xFFFFFFFF)
        reg = table[(reg ^ columns[j]) & np.uint32(0xFF)] ^ (reg >> np.uint32(8))
    return out


def candidates(arr: np.ndarray, lo: int, hi: int, tags: int, max_record: int) -> np.ndarray:
    """Header offsets ``c`` in [lo, hi) whose body opens with a fixarray and a tag in 1..tags and whose length
    fits the data (and ``max_record``)."""
    n = len(arr)
    a, b = lo + 8, min(hi + 8, n - 1)
    if a >= b:
        return np.empty(0, dtype=np.int64)
    first, second = arr[a:b], arr[a + 1 : b + 1]
    hits = np.flatnonzero((first >= 0x91) & (first <= 0x9F) & (second >= 1) & (second <= tags)).astype(np.int64) + lo
    if not hits.size:
        return hits
    length = (
        arr[hits].astype(np.int64)
        | arr[hits + 1].astype(np.int64) << 8
        | arr[hits + 2].astype(np.int64) << 16
        | arr[hits + 3].astype(np.int64) << 24
    )
    return hits[(length >= 2) & (length <= max_record) & (hits + 8 + length <= n)]


def next_record(data: bytes, start: int, tags: int, max_record: int, valid: Callable[[int], bool]) -> int:
    """The first offset >= ``start`` holding a valid record (``valid(offset)`` decodes it), else len(data)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    n = len(arr)
    for lo in range(start, n, SLICE):
        found = candidates(arr, lo, min(lo + SLICE, n), tags, max_record)
        for i in range(0, len(found), BATCH):
            c = found[i : i + BATCH]
            length = (
                arr[c].astype(np.int64)
                | arr[c + 1].astype(np.int64) << 8
                | arr[c + 2].astype(np.int64) << 16
                | arr[c + 3].astype(np.int64) << 24
            )
            stored = (
                arr[c + 4].astype(np.uint32)
                | arr[c + 5].astype(np.uint32) << 8
                | arr[c + 6].astype(np.uint32) << 16
                | arr[c + 7].astype(np.uint32) << 24
            )
            match = c[range_crcs(data, c + 8, c + 8 + length) == stored]
            for off in match.tolist():
                if valid(off):
                    return off
    return n
