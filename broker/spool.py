"""Append-only on-disk log of the broker's durable state.

Every accepted group, every lease of prompts (with the data cursor after it), every acknowledgement,
commit and rewind of a learner, every published version and every range of versions a rollback discarded is one record. Records are msgspec
frames behind an 8-byte header ``<u32 length><u32 crc32>``; a torn record at the tail (SIGKILL during
a write) fails its CRC and is cut off on replay. Records are written with ``write()`` before the
broker replies, so a killed *process* loses nothing it acknowledged; ``fsync`` (never / interval /
always) decides what survives a killed *machine*.

Compaction: when the active segment grows past ``segment_bytes`` a new segment is started with a
snapshot of the live state (queued and uncommitted groups, open prompts, cursor, version, discarded
versions, recent group ids), and every older segment is deleted.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Union

import msgspec

from fleetrl.common.messages import Prompt, SampleGroup, WeightsInfo

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")
SEEN_WINDOW = 1 << 16  # group ids remembered across a compaction for de-duplication


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


class VersionsDiscarded(Record, tag=10):  # a learner rolled these versions back (max_version -1: no end)
    min_version: int
    max_version: int = -1


AnyRecord = Union[GroupAccepted, GroupsDone, GroupsAcked, Committed, Rewound, PromptsLeased, PromptsRequeued, VersionSet,
                  SeenIds, VersionsDiscarded]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyRecord)


@dataclass
class Recovered:
    """Durable state rebuilt from the spool."""

    groups: "OrderedDict[str, SampleGroup]" = field(default_factory=OrderedDict)  # live, in arrival order
    uncommitted: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # client -> [(step, gid)]
    open_prompts: "OrderedDict[str, Prompt]" = field(default_factory=OrderedDict)  # leased or requeued, unfulfilled
    seen: "OrderedDict[str, None]" = field(default_factory=OrderedDict)
    epoch: int = 0
    pos: int = 0
    version: VersionSet | None = None
    discarded: list[tuple[int, int]] = field(default_factory=list)  # version ranges; -1: no upper end
    records: int = 0
    truncated_bytes: int = 0


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
    while len(state.seen) > 4 * SEEN_WINDOW:
        state.seen.popitem(last=False)


def _read_segment(path: Path) -> Iterator[tuple[int, Record | None]]:
    """Yield (end offset, record) for each intact record; (offset, None) at the first bad one."""
    data = path.read_bytes()
    off = 0
    while off < len(data):
        if off + HEADER.size > len(data):
            yield off, None
            return
        length, crc = HEADER.unpack_from(data, off)
        body = data[off + HEADER.size : off + HEADER.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            yield off, None
            return
        try:
            rec = _decoder.decode(body)
        except msgspec.MsgspecError:
            yield off, None
            return
        off += HEADER.size + length
        yield off, rec


class Spool:
    """Writer + replayer of the segment files in ``directory``."""

    def __init__(self, directory: str | Path, fsync: str = "interval", fsync_interval_s: float = 1.0,
                 segment_bytes: int = 256 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync_policy, self.fsync_interval_s, self.segment_bytes = fsync, fsync_interval_s, segment_bytes
        self._file = None
        self._index = 0
        self._dirty = False
        self._last_fsync = time.monotonic()
        self._unsynced = False  # flushed to the OS but not fsynced yet
        self.bytes_written = 0

    def _segments(self) -> list[Path]:
        return sorted(self.dir.glob("segment-*.log"))

    def recover(self) -> Recovered:
        """Rebuild state from every segment; cut a torn tail; open the newest segment for appends."""
        state = Recovered()
        segments = self._segments()
        for i, path in enumerate(segments):
            end = 0
            for end_off, rec in _read_segment(path):
                if rec is None:
                    size = path.stat().st_size
                    state.truncated_bytes += size - end_off
                    log.warning("spool %s: cut %d bytes of a torn record at offset %d", path.name, size - end_off, end_off)
                    with path.open("r+b") as f:
                        f.truncate(end_off)
                    break
                _apply(state, rec)
                state.records += 1
                end = end_off
            del end
            if i < len(segments) - 1 and state.truncated_bytes:
                log.warning("spool: a torn record sits before the newest segment %s", segments[-1].name)
        self._index = int(segments[-1].stem.split("-")[1]) if segments else 0
        self._open(self._index if segments else 1)
        return state

    def _open(self, index: int) -> None:
        if self._file:
            self._file.close()
        self._index = index
        self._file = open(self.dir / f"segment-{index:08d}.log", "ab")

    def append(self, rec: Record) -> None:
        body = _encoder.encode(rec)
        self._file.write(HEADER.pack(len(body), zlib.crc32(body)))
        self._file.write(body)
        self._dirty = True
        self.bytes_written += HEADER.size + len(body)

    def flush(self) -> None:
        """Hand written records to the OS (survives a killed process); fsync per policy."""
        if not self._dirty:
            return
        self._file.flush()
        self._dirty, self._unsynced = False, True
        if self.fsync_policy == "always":
            self._fsync(time.monotonic())
        else:
            self.sync_if_due()

    def sync_if_due(self) -> None:
        """With ``fsync: interval``, fsync what was flushed once ``fsync_interval_s`` has passed since the last
        fsync; the broker also calls this on its timer, so the last records of a burst do not wait for more."""
        now = time.monotonic()
        if self.fsync_policy == "interval" and self._unsynced and now - self._last_fsync >= self.fsync_interval_s:
            self._fsync(now)

    def _fsync(self, now: float) -> None:
        os.fsync(self._file.fileno())
        self._last_fsync, self._unsynced = now, False

    def needs_compaction(self) -> bool:
        return self._file is not None and self._file.tell() >= self.segment_bytes

    def compact(self, snapshot: list[Record]) -> None:
        """Start a new segment holding ``snapshot`` (the live state), then delete older segments."""
        old = self._segments()
        self.flush()
        self._open(self._index + 1)
        for rec in snapshot:
            self.append(rec)
        self._file.flush()
        self._fsync(time.monotonic())
        self._dirty = False
        for path in old:
            path.unlink(missing_ok=True)
        log.info("spool compacted into %s (%d records, %d old segments removed)",
                 self.dir / f"segment-{self._index:08d}.log", len(snapshot), len(old))

    def close(self) -> None:
        if self._file:
            self.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
