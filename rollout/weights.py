"""`WeightReceiver`: a rollout server takes in new policy versions (docs/weight_sync.md).

The server hands every version announcement to :meth:`WeightReceiver.on_version` and calls
:meth:`WeightReceiver.apply` between generation batches. Neither waits on the network:

- ``filesystem``: ``on_version`` remembers the newest path; ``apply`` loads it into the engine.
- ``gloo`` / ``nccl``: ``on_version`` hands the round to a background thread, which joins it through
  the learner's TCPStore, forms (or reuses) the group and receives every bucket into flat buffers;
  only a version received whole becomes pending, and ``apply`` passes it to
  ``engine.update_weights`` in one call. A failed, late or timed-out round is logged and skipped:
  the next announcement brings the newest version. While a round is being received, newer
  announcements wait in a one-slot queue (only the newest is kept).

Versions only move forward: an announcement not newer than what is held, pending or being received
is ignored. The engine's initial weights count as version 0.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import PrefixStore, TCPStore

from fleetrl.common import messages
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig
from fleetrl.rollout.engines.base import Engine, ParamSpec

log = logging.getLogger(__name__)


class RoundSkipped(Exception):
    """This receiver is not part of a round (it came too late, or the learner left it out)."""


@dataclass
class Update:
    """One complete version waiting to be applied: a directory, or received tensors."""

    version: int
    key: tuple[float, int] = (0.0, 0)  # (published_at, version): what "newer" means, across rollbacks
    path: str = ""
    named: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Group:
    id: str
    store: tuple[str, int]  # which learner's store the group was formed on
    pg: Any


class WeightReceiver:
    def __init__(self, cfg: JobConfig, specs: list[ParamSpec], device: str, client_id: str):
        self.cfg = cfg.sync
        self.expected = {name: (tuple(shape), ws.dtype_name(dtype)) for name, shape, dtype in specs}
        self.device = buffer_device(self.cfg.transport, device)
        self.identity = f"{client_id}/{uuid.uuid4().hex[:8]}"
        self._cv = threading.Condition()
        self._held = 0  # the version the engine holds
        self._held_key: tuple[float, int] = (0.0, 0)
        self._pending: Update | None = None
        self._queued: tuple[int, messages.WeightsInfo] | None = None
        self._receiving: tuple[float, int] | None = None
        self._loading: tuple[float, int] = (0.0, 0)  # key of the update apply() is handing to the engine
        self._closed = False
        self._thread: threading.Thread | None = None
        self._store: tuple[tuple[str, int], TCPStore] | None = None  # worker thread only
        self._group: _Group | None = None  # worker thread only
        self._spare: list[torch.Tensor] = []  # flat buffers of the last applied update, reused
        self._stats = {"weights/version": 0.0, "weights/load_s": 0.0, "weights/recv_s": 0.0,
                       "weights/recv_mb_per_s": 0.0, "weights/rounds_ok": 0.0, "weights/rounds_missed": 0.0}

    # ------------------------------------------------------------------------- server side

    def on_version(self, version: int, weights: messages.WeightsInfo) -> None:
        """Take note of an announced version (returns at once; see the module docstring)."""
        if weights.transport == "none":
            return
        key = (weights.published_at, version)
        with self._cv:
            if self._closed or key <= self._newest_known():
                return
            if weights.transport == "filesystem":
                self._pending = Update(version, key, path=weights.path)
                return
            reason = ws.check_plan(weights.buckets, self.expected)
            if reason:
                log.error("weight version %d cannot be received: %s", version, reason)
                self._stats["weights/rounds_missed"] += 1
                return
            self._queued = (version, weights)
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetrl-weights", daemon=True)
                self._thread.start()

    def _newest_known(self) -> tuple[float, int]:
        """The newest (published_at, version) held, loading, pending, queued or being received.

        Ordering by the learner's publish time first makes a resumed or rolled-back learner's lower
        version win over the newer number a rollout still holds."""
        candidates = [self._held_key, self._loading, self._receiving or (0.0, 0)]
        candidates += [u.key for u in (self._pending,) if u is not None]
        candidates += [(q[1].published_at, q[0]) for q in (self._queued,) if q is not None]
        return max(candidates)

    def pending_version(self) -> int | None:
        """The newest complete version not yet applied (filesystem: announced), or None."""
        with self._cv:
            return self._pending.version if self._pending is not None else None

    def apply(self, engine: Engine) -> int | None:
        """Load the newest complete version into ``engine``; returns it, or None if nothing is new."""
        with self._cv:
            update, self._pending = self._pending, None
            self._loading = update.key if update is not None else (0.0, 0)
        if update is None:
            return None
        t0 = time.perf_counter()
        try:
            loaded = self._load(engine, update)
        finally:
            with self._cv:
                self._loading = (0.0, 0)
        if not loaded:
            return None
        log.info("loaded weight version %d in %.2fs", update.version, time.perf_counter() - t0)
        return update.version

    def _load(self, engine: Engine, update: Update) -> bool:
        """Hand ``update`` to the engine; False when its files are gone."""
        t0 = time.perf_counter()
        if update.path:
            if not Path(update.path).is_dir():
                log.warning("weight version %d at %s is gone (pruned: raise sync.keep_versions if this repeats); "
                            "waiting for the next version", update.version, update.path)
                return False
            engine.load_weights_from_dir(update.path)
        else:
            engine.update_weights(update.named)
        with self._cv:
            if update.key >= self._held_key:
                self._held, self._held_key = update.version, update.key
            self._spare = update.buffers
            self._stats["weights/version"] = float(self._held)
            self._stats["weights/load_s"] = time.perf_counter() - t0
        return True

    def stats(self) -> dict[str, float]:
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a round in progress ends at its timeout; the thread is a daemon

    # ------------------------------------------------------------------------- worker thread

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while self._queued is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    break
                (version, info), self._queued = self._queued, None
                self._receiving = (info.published_at, version)
            update = self._receive_round(version, info)
            with self._cv:
                self._receiving = None
                if update is None:
                    self._stats["weights/rounds_missed"] += 1
                elif update.key > max([self._held_key] + [u.key for u in (self._pending,) if u is not None]):
                    self._pending = update
        self._drop_group()
        self._store = None

    def _receive_round(self, version: int, info: messages.WeightsInfo) -> Update | None:
        t0 = time.monotonic()
        try:
            update = self._join_and_receive(version, info, t0 + self.cfg.timeout_s)
        except RoundSkipped as e:
            log.info("weight version %d: %s; waiting for the next version", version, e)
            return None
        except Exception as e:  # noqa: BLE001 - the learner or a peer failed: skip this round
            log.warning("weight version %d: round %d with the learner at %s:%d failed (%s: %s); keeping version %d "
                        "until the next one", version, info.round_id, info.master_addr, info.master_port,
                        type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", self._held)
            self._drop_group()
            self._store = None
            return None
        seconds = time.monotonic() - t0
        nbytes = sum(b.numel() * b.element_size() for b in update.buffers)
        with self._cv:
            self._stats["weights/recv_s"] = seconds
            self._stats["weights/recv_mb_per_s"] = nbytes / ws.MB / seconds if seconds > 0 else 0.0
            self._stats["weights/rounds_ok"] += 1
        return update

    def _join_and_receive(self, version: int, info: messages.WeightsInfo, deadline: float) -> Update:
        key = (info.master_addr, info.master_port)
        store = self._connect(key)
        rid = info.round_id
        n = store.add(ws.count_key(rid), 1)
        if n > ws.CLOSED:
            raise RoundSkipped(f"round {rid} closed before this server joined")
        held = self._group.id if self._group is not None and self._group.store == key else ""
        store.set(ws.member_key(rid, n), messages.encode_record(messages.JoinRecord(self.identity, held)))
        store.wait([ws.plan_key(rid)], _remaining(deadline))
        plan = messages.decode_plan(store.get(ws.plan_key(rid)))
        if self.identity not in plan.ranks:
            raise RoundSkipped(f"the learner left this server out of round {rid}")
        if not (plan.reuse and held == plan.group):
            self._drop_group()
            host = ws.local_address_towards(*key)
            pg = ws.new_group(self.cfg.transport, PrefixStore(ws.group_prefix(plan.group), store),
                              plan.ranks[self.identity], plan.size, deadline - time.monotonic(), host)
            self._group = _Group(plan.group, key, pg)
        layouts = [ws.bucket_layout(b) for b in info.buckets]
        buffers = self._buffers(layouts)
        for buf in buffers:
            self._recv_bucket(self._group.pg, buf, deadline)
        named = [(s.name, buf[s.offset : s.offset + s.numel].view(s.shape))
                 for layout, buf in zip(layouts, buffers) for s in layout.slots]
        return Update(version, (info.published_at, version), named=named, buffers=buffers)

    def _recv_bucket(self, pg: Any, buf: torch.Tensor, deadline: float) -> None:
        ws.wait(ws.broadcast(pg, buf, deadline - time.monotonic()), deadline - time.monotonic())

    def _connect(self, key: tuple[str, int]) -> TCPStore:
        if self._store is None or self._store[0] != key:
            self._drop_group()
            store = TCPStore(key[0], key[1], None, False, timeout=timedelta(seconds=self.cfg.timeout_s))
            self._store = (key, store)
        return self._store[1]

    def _buffers(self, layouts: list[ws.BucketLayout]) -> list[torch.Tensor]:
        """One flat buffer per bucket; the last applied update's buffers when their layout matches."""
        with self._cv:
            spare, self._spare = self._spare, []
        if [(b.numel(), ws.dtype_name(b.dtype)) for b in spare] == [(lay.numel, lay.dtype) for lay in layouts]:
            return spare
        return [torch.empty(lay.numel, dtype=getattr(torch, lay.dtype), device=self.device) for lay in layouts]

    def _drop_group(self) -> None:
        if self._group is not None:
            ws.release_group(self._group.pg)
            self._group = None


def buffer_device(transport: str, device: str) -> torch.device:
    """Where received buckets land: the rollout's GPU for nccl, else CPU."""
    if transport != "nccl":
        return torch.device("cpu")
    resolved = torch.device("cuda" if device == "auto" else device)
    if resolved.type != "cuda":
        raise ValueError(f"sync.transport=nccl needs the rollout on a GPU (rollout.device={device!r}); "
                         "use sync.transport=gloo or filesystem for CPU rollouts")
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


def _remaining(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.1, deadline - time.monotonic()))
