"""Append-only on-disk log of the broker's durable state.

Every accepted group, every lease of prompts (with the data cursor after it), every acknowledgement,
commit and rewind of a learner, every published version and every range of versions a rollback
discarded is one record. Records are msgspec frames behind an 8-byte header ``<u32 length><u32 crc32>``.

**Durable before acknowledged.** :meth:`Spool.write` hands a request's records to the OS with one
``write()`` *before* the broker changes its state or replies. A write that fails (a full disk) is cut
back off the file and raises :class:`SpoolUnavailable`; the broker then answers ``unavailable`` and
has changed nothing, so the client's retry is ingested as new. ``fsync`` (never / interval / always)
decides what survives a killed *machine*; a killed *process* loses nothing it acknowledged.

**Recovery resynchronises.** A damaged record (a torn tail after a crash, a flipped bit anywhere) is
skipped: the reader looks for the next offset that holds a valid header, CRC and record, keeps every
record after it, copies the damaged bytes to ``<spool>/quarantine/`` and reports how many records it
kept and how many bytes it skipped. A damaged tail is cut off so that appends continue after it.

Compaction: when the active segment grows past ``segment_bytes`` a new segment is started with a
snapshot of the live state, fsynced, and every older segment is deleted. Files are owner-only
(directory 0700, segments 0600).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import time
import typing
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgspec

from fleetrl.common import faults
from fleetrl.common.config import ConfigError
from fleetrl.common.messages import Prompt, SampleGroup, WeightsInfo

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")
SEEN_WINDOW = 1 << 16  # group ids remembered across a compaction for de-duplication
MAX_RECORD = 1 << 30  # no record is larger (a group is at most broker.max_message_bytes)


class SpoolError(ConfigError):
    """The spool directory holds something the broker cannot start from (one line at start-up)."""


class SpoolUnavailable(Exception):
    """A spool write failed (ENOSPC, EDQUOT, EIO...); nothing of it is left in the file."""

    def __init__(self, err: OSError):
        name = errno.errorcode.get(err.errno or 0, "error")
        super().__init__(f"{name}: {err.strerror or err}")
        self.errno = err.errno


class Record(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag_field="t"):
    pass


class GroupAccepted(Record, tag=1):
    group: SampleGroup


class GroupsDone(Record, tag=2):  # consumed for good: trained (and committed), dropped or discarded
    group_ids: list[str]


class GroupsAcked(Record, tag=3):  # trained, kept until a checkpoint commits them
    client_id: str
    step: int
    group_ids: list[str]


class Committed(Record, tag=4):
    client_id: str
    step: int


class Rewound(Record, tag=5):
    client_id: str
    step: int


class PromptsLeased(Record, tag=6):
    prompts: list[Prompt]
    epoch: int
    pos: int


class PromptsRequeued(Record, tag=7):
    prompts: list[Prompt]


class VersionSet(Record, tag=8):
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)


class SeenIds(Record, tag=9):
    group_ids: list[str]


class VersionsDiscarded(Record, tag=10):  # a rollback discarded [min_version, max_version] (-1: an old open range)
    min_version: int
    max_version: int = -1


class BatchLeased(Record, tag=11):  # who holds which groups (a late ack after a restart takes back only these)
    lease_id: str
    client_id: str
    group_ids: list[str]


class DiscardsSet(Record, tag=12):  # an operator's resume lifted the ranges discarded during its pause: these remain
    ranges: list[tuple[int, int]]


AnyRecord = (
    GroupAccepted
    | GroupsDone
    | GroupsAcked
    | Committed
    | Rewound
    | PromptsLeased
    | PromptsRequeued
    | VersionSet
    | SeenIds
    | VersionsDiscarded
    | BatchLeased
    | DiscardsSet
)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyRecord)
_TAGS = len(typing.get_args(AnyRecord))
_ARRAY = re.compile(rb"[\x91-\x9f]")  # a record body opens with a msgpack fixarray header (a record has < 16 fields)


@dataclass
class Recovered:
    """Durable state rebuilt from the spool, and what the replay had to skip."""

    groups: OrderedDict[str, SampleGroup] = field(default_factory=OrderedDict)  # live, in arrival order
    uncommitted: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # client -> [(step, gid)]
    open_prompts: OrderedDict[str, Prompt] = field(default_factory=OrderedDict)  # leased or requeued, unfulfilled
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    epoch: int = 0
    pos: int = 0
    version: VersionSet | None = None
    discarded: list[tuple[int, int]] = field(default_factory=list)  # closed version ranges; -1: an old open end
    batch_leases: OrderedDict[str, tuple[str, list[str]]] = field(
        default_factory=OrderedDict
    )  # lease -> (client, gids)
    records: int = 0  # kept
    skipped_bytes: int = 0  # damaged bytes skipped (and quarantined)
    damaged: int = 0  # damaged regions
    quarantined: list[str] = field(default_factory=list)  # side files holding them
    needs_rewrite: bool = False  # damage before the tail: compact so the next replay is clean


def _apply(state: Recovered, rec: Record) -> None:
    if isinstance(rec, GroupAccepted):
        g = rec.group
        state.groups[g.group_id] = g
        state.seen[g.group_id] = None
        state.open_prompts.pop(g.prompt_id, None)
    elif isinstance(rec, GroupsDone):
        for gid in rec.group_ids:
            state.groups.pop(gid, None)
    elif isinstance(rec, GroupsAcked):
        state.uncommitted.setdefault(rec.client_id, []).extend((rec.step, gid) for gid in rec.group_ids)
    elif isinstance(rec, Committed):
        entries = state.uncommitted.get(rec.client_id, [])
        for step, gid in entries:
            if step <= rec.step:
                state.groups.pop(gid, None)
        state.uncommitted[rec.client_id] = [(s, g) for s, g in entries if s > rec.step]
    elif isinstance(rec, Rewound):
        entries = state.uncommitted.get(rec.client_id, [])
        state.uncommitted[rec.client_id] = [(s, g) for s, g in entries if s <= rec.step]
    elif isinstance(rec, PromptsLeased):
        for p in rec.prompts:
            state.open_prompts[p.prompt_id] = p
        state.epoch, state.pos = rec.epoch, rec.pos
    elif isinstance(rec, PromptsRequeued):
        for p in rec.prompts:
            state.open_prompts[p.prompt_id] = p
    elif isinstance(rec, VersionSet):
        state.version = rec
    elif isinstance(rec, SeenIds):
        for gid in rec.group_ids:
            state.seen[gid] = None
    elif isinstance(rec, VersionsDiscarded):
        state.discarded.append((rec.min_version, rec.max_version))
    elif isinstance(rec, DiscardsSet):
        state.discarded = [(lo, hi) for lo, hi in rec.ranges]
    elif isinstance(rec, BatchLeased):
        state.batch_leases[rec.lease_id] = (rec.client_id, rec.group_ids)
        while len(state.batch_leases) > 4096:
            state.batch_leases.popitem(last=False)
    while len(state.seen) > 4 * SEEN_WINDOW:
        state.seen.popitem(last=False)


def encode_records(records: list[Record]) -> bytes:
    """Header + body of each record, back to back (raises ValueError for a record that cannot be encoded)."""
    out = []
    for rec in records:
        try:
            body = _encoder.encode(rec)
        except (RecursionError, msgspec.MsgspecError, OverflowError) as e:
            raise ValueError(f"{type(rec).__name__} cannot be spooled: {type(e).__name__}: {e}") from None
        out.append(HEADER.pack(len(body), zlib.crc32(body)))
        out.append(body)
    return b"".join(out)


def record_at(data: bytes, off: int) -> tuple[Record | None, int]:
    """The valid record starting at ``off`` and the offset after it, or (None, 0)."""
    if off + HEADER.size >= len(data):
        return None, 0
    length, crc = HEADER.unpack_from(data, off)
    end = off + HEADER.size + length
    if length < 2 or length > MAX_RECORD or end > len(data):
        return None, 0
    if not 1 <= data[off + HEADER.size + 1] <= _TAGS:  # [tag, ...]: the tag follows the array header
        return None, 0
    body = memoryview(data)[off + HEADER.size : end]
    if zlib.crc32(body) != crc:
        return None, 0
    try:
        return _decoder.decode(body), end
    except msgspec.MsgspecError:
        return None, 0


def scan(data: bytes) -> tuple[list[Record], list[tuple[int, int]]]:
    """Every valid record of a segment, and the damaged byte ranges ``[start, end)`` between them.

    After a bad record, the next record is looked for at every later offset whose body would open with
    an array header (a regex over the bytes, in C); the first one whose header, CRC and body are valid
    resynchronises the reader."""
    records, damaged, off = [], [], 0
    while off < len(data):
        rec, end = record_at(data, off)
        if rec is not None:
            records.append(rec)
            off = end
            continue
        nxt = len(data)
        for m in _ARRAY.finditer(data, off + 1 + HEADER.size):
            if record_at(data, m.start() - HEADER.size)[0] is not None:
                nxt = m.start() - HEADER.size
                break
        damaged.append((off, nxt))
        off = nxt
    return records, damaged


def _owner_only_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def write_owner_only(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class Spool:
    """Writer + replayer of the segment files in ``directory``."""

    def __init__(
        self,
        directory: str | Path,
        fsync: str = "interval",
        fsync_interval_s: float = 1.0,
        segment_bytes: int = 256 << 20,
    ):
        self.dir = Path(directory)
        _owner_only_dir(self.dir)
        self.fsync_policy, self.fsync_interval_s, self.segment_bytes = fsync, fsync_interval_s, segment_bytes
        self._fd: int | None = None
        self._index = 0
        self._size = 0  # bytes in the active segment (a failed write is truncated back to it)
        self._last_fsync = time.monotonic()
        self._unsynced = False  # written to the OS but not fsynced yet
        self.bytes_written = 0
        self.write_errors = 0

    def _segments(self) -> list[Path]:
        """The segment files, oldest first; raises SpoolError for something else under a segment's name (a
        directory, a symlink, a name without an index), which must not stop start-up with a traceback."""
        out = sorted(self.dir.glob("segment-*.log"))
        for path in out:
            if path.is_symlink() or not path.is_file():
                what = "a symlink" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
                raise SpoolError(f"spool segment {path} is {what}; move it out of broker.spool_dir ({self.dir})")
            if not path.stem.split("-", 1)[1].isdigit():
                raise SpoolError(
                    f"spool file {path} is not a segment (segment-<index>.log); move it out of "
                    f"broker.spool_dir ({self.dir})"
                )
        return out

    def _path(self, index: int) -> Path:
        return self.dir / f"segment-{index:08d}.log"

    # ------------------------------------------------------------------ recovery
    def recover(self) -> Recovered:
        """Rebuild state from every segment (see the module docstring); open the newest for appends."""
        state = Recovered()
        segments = self._segments()
        for path in segments:
            data = path.read_bytes()
            records, damaged = scan(data)
            for rec in records:
                _apply(state, rec)
            state.records += len(records)
            for start, end in damaged:
                self._quarantine(state, path, data, start, end)
            if damaged and damaged[-1][1] == len(data):  # a damaged tail: appends continue after the cut
                with path.open("r+b") as f:
                    f.truncate(damaged[-1][0])
            state.needs_rewrite |= any(end < len(data) for _, end in damaged) or (
                bool(damaged) and path != segments[-1]
            )
        if state.damaged:
            log.warning(
                "spool %s: kept %d records, skipped %d damaged bytes in %d region(s), quarantined to %s",
                self.dir,
                state.records,
                state.skipped_bytes,
                state.damaged,
                self.dir / "quarantine",
            )
        self._open(int(segments[-1].stem.split("-")[1]) if segments else 1)
        return state

    def _quarantine(self, state: Recovered, path: Path, data: bytes, start: int, end: int) -> None:
        qdir = self.dir / "quarantine"
        _owner_only_dir(qdir)
        side = qdir / f"{path.stem}.at-{start}.bin"
        write_owner_only(side, data[start:end])
        state.skipped_bytes += end - start
        state.damaged += 1
        state.quarantined.append(str(side))
        log.warning(
            "spool %s: %d damaged bytes at offset %d skipped (copied to %s)", path.name, end - start, start, side
        )

    # -------------------------------------------------------------------- writes
    def _open(self, index: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._index = index
        path = self._path(index)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.chmod(path, 0o600)
        self._size = os.fstat(self._fd).st_size

    def write(self, records: list[Record]) -> None:
        """Hand ``records`` to the OS in one write, or raise: ValueError (a record that cannot be encoded:
        nothing written) or SpoolUnavailable (the write failed: its bytes are cut off again)."""
        if not records:
            return
        data = encode_records(records)
        view, start = memoryview(data), self._size
        fd = cast(int, self._fd)  # open from __init__ until close
        try:
            view = faults.at("broker.spool_write", view, fd=fd)  # a chaos run stops half-way through
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as e:
            self.write_errors += 1
            try:
                os.ftruncate(fd, start)
            except OSError:  # pragma: no cover - recovery resynchronises past a partial record anyway
                log.exception("spool: could not cut a partial write back off %s", self._path(self._index))
            raise SpoolUnavailable(e) from None
        self._size = start + len(data)
        self._unsynced = True
        self.bytes_written += len(data)

    def append(self, rec: Record) -> None:
        self.write([rec])

    def flush(self) -> None:
        """After a batch of requests, before the replies: fsync with ``fsync: always``, else when due."""
        if self.fsync_policy == "always":
            if self._unsynced:
                self._fsync(time.monotonic())
        else:
            self.sync_if_due()

    def sync_if_due(self) -> None:
        """With ``fsync: interval``, fsync what was written once ``fsync_interval_s`` has passed since the last
        fsync; the broker also calls this on its timer, so the last records of a burst do not wait for more."""
        now = time.monotonic()
        if self.fsync_policy == "interval" and self._unsynced and now - self._last_fsync >= self.fsync_interval_s:
            self._fsync(now)

    def _fsync(self, now: float) -> None:
        os.fsync(cast(int, self._fd))
        self._last_fsync, self._unsynced = now, False

    # ----------------------------------------------------------------- compaction
    def needs_compaction(self) -> bool:
        return self._fd is not None and self._size >= self.segment_bytes

    def compact(self, snapshot: list[Record]) -> None:
        """Start a new segment holding ``snapshot`` (the live state), then delete older segments.
        Raises SpoolUnavailable (the new segment is removed, the old ones stay) when the disk is full."""
        old = self._segments()
        path = self._path(self._index + 1)
        try:
            data = encode_records(snapshot)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            path.unlink(missing_ok=True)
            raise SpoolUnavailable(e) from None
        self._open(self._index + 1)
        self._last_fsync, self._unsynced = time.monotonic(), False
        for p in old:
            p.unlink(missing_ok=True)
        log.info("spool compacted into %s (%d records, %d old segments removed)", path, len(snapshot), len(old))

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as e:  # pragma: no cover - reported; the records reached the OS
                log.error("spool: fsync at close failed: %s", e)
            os.close(self._fd)
            self._fd = None
