"""`WeightReceiver`: a rollout server takes in new policy versions (docs/weight_sync.md).

The server hands every version announcement to :meth:`WeightReceiver.on_version` and calls
:meth:`WeightReceiver.apply` between generation batches. Neither waits on the network. The transport
comes from the ``RECEIVERS`` registry by ``sync.transport``, mirroring the learner's ``SENDERS``:

- ``filesystem`` (:class:`FileReceiver`): the announced directory becomes pending; ``apply`` loads it.
- ``gloo`` / ``nccl`` (:class:`BroadcastReceiver`): a background thread joins the round through the
  learner's TCPStore with the round's secret, forms (or reuses) the group and receives every bucket
  into flat buffers (the functions of ``rounds.py``, which a vLLM worker calls too). A bucket that does
  not arrive (a dead peer) sends it into the re-formed round, so it still gets the version. A round it
  missed (too late, left out) is asked for again as a **catch-up** round, served by the learner from a
  host copy: a rollout that fell behind catches up instead of being throttled forever. Only a version
  received whole becomes pending; while a round runs, newer announcements wait in a one-slot queue.

Versions only move forward, ordered by ``(published_at, version)`` — ``published_at`` is stamped by the
broker, so a resumed or rolled-back learner's lower version still wins. An announcement not newer than
what is held, pending or being received is ignored; so is one whose ``published_at`` lies more than
``sync.max_clock_skew_s`` in the future, and one that already failed here (tried again after
``RETRY_FAILED_S``). The engine's initial weights count as version 0.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from fleetrl.common import messages
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, SyncConfig
from fleetrl.common.plugins.registry import Registry
from fleetrl.common.weightsync.receiver.broadcast import Joined, RoundSkipped, receive_round, request_catchup

if TYPE_CHECKING:  # torch is imported where it is used: this package imports without it
    import torch
    from torch.distributed import TCPStore

log = logging.getLogger(__name__)

Key = tuple[float, int]  # (published_at, version): what "newer" means, across resumes and rollbacks
RETRY_FAILED_S = 30.0  # a version whose round failed here is tried again (catch-up) at most this often
CATCHUP_WAIT_S = ws.JOIN_WINDOW_S + 10.0  # how long a receiver waits for the learner to offer a catch-up round

RECEIVERS: Registry[type] = Registry("weight transport", config_key="sync.transport")


EngineSpec = tuple[str, tuple[int, ...], "torch.dtype"]  # (name, shape, dtype): an engine's param_specs()


class WeightSink(Protocol):
    """What a receiver loads weights into: a rollout engine (``rollout/engines/base.py``'s ``Engine``)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def load_weights_from_dir(self, path: str) -> None: ...


@dataclass
class Update:
    """One complete version waiting to be applied: a directory, or received tensors."""

    version: int
    key: Key = (0.0, 0)
    path: str = ""
    named: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)


class WeightReceiver:
    receivers = 1  # weight receivers this handle stands for (the server registers the count with the broker)

    def __init__(self, cfg: JobConfig, specs: list[EngineSpec], device: str, client_id: str):
        self.cfg = cfg.sync
        self.identity = f"{client_id}/{uuid.uuid4().hex[:8]}"
        self._cv = threading.Condition()
        self._held, self._held_key = 0, (0.0, 0)  # the version the engine holds
        self._pending: Update | None = None
        self._loading: Key = (0.0, 0)  # key of the update apply() is handing to the engine
        self._failed: dict[Key, float] = {}  # versions whose round failed here -> when
        self._closed = False
        # called (on the transport's thread) when a complete version is held: the rollout's main loop waits
        # on an event between polls, and a version that waits for the next poll leaves its weights a version
        # behind the broker's count for up to a poll slice (issue 24)
        self.on_ready: Callable[[], None] = lambda: None
        self._stats = {
            "weights/version": 0.0,
            "weights/load_s": 0.0,
            "weights/recv_s": 0.0,
            "weights/recv_mb_per_s": 0.0,
            "weights/rounds_ok": 0.0,
            "weights/rounds_missed": 0.0,
            "weights/catchups": 0.0,
            "weights/reforms": 0.0,
            "weights/rejected": 0.0,
            "weights/forged": 0.0,
        }
        self.transport = RECEIVERS[self.cfg.transport](
            self.cfg, specs, device, self.identity, self._deliver, self._count
        )

    # ------------------------------------------------------------------------- server side

    def on_version(self, version: int, weights: messages.WeightsInfo) -> None:
        """Take note of an announced version (returns at once; see the module docstring)."""
        if weights.transport == "none":
            return
        key = (weights.published_at, version)
        with self._cv:
            if self._closed or key <= self._newest_known() or time.monotonic() < self._failed.get(key, 0.0):
                return
            if weights.published_at > time.time() + self.cfg.max_clock_skew_s:
                self._stats["weights/rejected"] += 1
                log.error(
                    "ignored weight version %d: published_at %.0f lies in the future (more than "
                    "sync.max_clock_skew_s=%g s); check the machines' clocks",
                    version,
                    weights.published_at,
                    self.cfg.max_clock_skew_s,
                )
                return
        self.transport.offer(version, weights, key)

    def _newest_known(self) -> Key:
        """The newest key held, loading, pending, queued or being received (call with the lock held)."""
        candidates = [self._held_key, self._loading, self.transport.busy_key()]
        return max(candidates + [u.key for u in (self._pending,) if u is not None])

    def _deliver(self, update: Update | None, key: Key) -> None:
        """(transport) A version arrived whole, or (None) its round failed."""
        with self._cv:
            if update is None:
                self._stats["weights/rounds_missed"] += 1
                self._failed = {k: t for k, t in self._failed.items() if t > time.monotonic()}
                self._failed[key] = time.monotonic() + RETRY_FAILED_S
                return
            if update.key <= max([self._held_key] + [u.key for u in (self._pending,) if u is not None]):
                return
            self._pending = update
        self.on_ready()

    def _count(self, name: str, n: float = 1.0, set_to: bool = False) -> None:
        with self._cv:
            self._stats[name] = n if set_to else self._stats[name] + n

    def pending_version(self) -> int | None:
        """The newest complete version not yet applied (filesystem: announced), or None."""
        with self._cv:
            return self._pending.version if self._pending is not None else None

    def apply(self, engine: WeightSink) -> int | None:
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
        log.debug("loaded weight version %d in %.2fs", update.version, time.perf_counter() - t0)  # the server says it
        return update.version

    def _load(self, engine: WeightSink, update: Update) -> bool:
        """Hand ``update`` to the engine; False when its files are gone."""
        t0 = time.perf_counter()
        if update.path:
            if not Path(update.path).is_dir():
                log.warning(
                    "weight version %d at %s is gone (pruned: raise sync.keep_versions if this repeats); "
                    "waiting for the next version",
                    update.version,
                    update.path,
                )
                return False
            engine.load_weights_from_dir(update.path)
            nbytes = sum(f.stat().st_size for f in Path(update.path).glob("*.safetensors"))
        else:
            engine.update_weights(update.named)
            nbytes = sum(t.numel() * t.element_size() for _, t in update.named)
        with self._cv:
            if update.key >= self._held_key:
                self._held, self._held_key = update.version, update.key
            self.transport.recycle(update.buffers)
            self._stats["weights/version"] = float(self._held)
            self._stats["weights/load_s"] = seconds = time.perf_counter() - t0
            self._stats["weights/load_mb"] = nbytes / (1 << 20)  # load bandwidth: what a sync costs this server
            self._stats["weights/load_mb_per_s"] = nbytes / (1 << 20) / max(seconds, 1e-9)
        return True

    def stats(self) -> dict[str, float]:
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            self._closed = True
        self.transport.close()


# ---------------------------------------------------------------------------------- filesystem


@RECEIVERS.register("filesystem")
class FileReceiver:
    """The announced directory is the update: nothing to receive."""

    def __init__(self, cfg: SyncConfig, specs, device: str, identity: str, deliver: Callable, count: Callable):
        self.deliver = deliver

    def offer(self, version: int, weights: messages.WeightsInfo, key: Key) -> None:
        self.deliver(Update(version, key, path=weights.path), key)

    def busy_key(self) -> Key:
        return (0.0, 0)

    def recycle(self, buffers: list) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------- broadcast


@RECEIVERS.register("gloo", "nccl")
class BroadcastReceiver:
    """Rounds on a thread of their own (module docstring); ``deliver`` gets each outcome."""

    def __init__(
        self, cfg: SyncConfig, specs: list[EngineSpec], device: str, identity: str, deliver: Callable, count: Callable
    ):
        self.cfg, self.identity, self.deliver, self.count = cfg, identity, deliver, count
        self.expected = {name: (tuple(shape), ws.dtype_name(dtype)) for name, shape, dtype in specs}
        self.device = buffer_device(cfg.transport, device)
        self._cv = threading.Condition()
        self._queued: tuple[int, messages.WeightsInfo, Key] | None = None
        self._receiving: Key | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._store: tuple[tuple[str, int], TCPStore] | None = None  # worker thread only
        self._held: Joined | None = None  # the group held from the last round (worker thread only)
        self._spare: list[torch.Tensor] = []  # flat buffers of the last applied update, reused

    def offer(self, version: int, weights: messages.WeightsInfo, key: Key) -> None:
        reason = ws.check_plan(weights.buckets, self.expected)
        if not reason and not weights.signer:
            reason = (
                "the announcement carries no signing key (sync.transport gloo/nccl needs a learner of this "
                "fleetrl version: receivers take only plans and buckets the learner signed)"
            )
        if reason:
            log.error("weight version %d cannot be received: %s", version, reason)
            self.deliver(None, key)
            return
        with self._cv:
            if self._closed:
                return
            if self._queued is None or key > self._queued[2]:
                self._queued = (version, weights, key)
            self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetrl-weights", daemon=True)
                self._thread.start()

    def busy_key(self) -> Key:
        with self._cv:
            keys = [k for k in (self._receiving, self._queued[2] if self._queued else None) if k is not None]
        return max(keys, default=(0.0, 0))

    def recycle(self, buffers: list) -> None:
        with self._cv:
            self._spare = buffers

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a round in progress ends at its timeout; the thread is a daemon

    def _run(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while self._queued is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    break
                queued, self._queued = self._queued, None
                version, info, key = cast("tuple[int, messages.WeightsInfo, Key]", queued)  # not None: waited for
                self._receiving = key
            update = self._receive(version, info, key)
            with self._cv:
                self._receiving = None
            self.deliver(update, key)
        self._drop_group()

    def _receive(self, version: int, info: messages.WeightsInfo, key: Key) -> Update | None:
        t0 = time.monotonic()
        try:
            update = self._join_and_receive(version, info, key, t0 + self.cfg.timeout_s)
        except Exception as e:  # noqa: BLE001 - the learner or a peer failed: skip this round
            log.warning(
                "weight version %d: round %d with the learner at %s:%d failed (%s: %s); keeping the weights "
                "held until the next version",
                version,
                info.round_id,
                info.master_addr,
                info.master_port,
                type(e).__name__,
                str(e).splitlines()[0][:300] if str(e) else "",
            )
            self._drop_group()
            self._store = None
            return None
        if update is None:
            return None
        seconds = time.monotonic() - t0
        nbytes = sum(b.numel() * b.element_size() for b in update.buffers)
        self.count("weights/recv_s", seconds, set_to=True)
        self.count("weights/recv_mb_per_s", nbytes / ws.MB / seconds if seconds > 0 else 0.0, set_to=True)
        self.count("weights/rounds_ok")
        return update

    def _join_and_receive(self, version: int, info: messages.WeightsInfo, key: Key, deadline: float) -> Update | None:
        addr = (info.master_addr, info.master_port)
        store = self._connect(addr)
        layouts = [ws.bucket_layout(b) for b in info.buckets]
        keys = ws.RoundKeys(info.secret, info.round_id)
        host = ws.local_address_towards(*addr)
        held = self._held if self._store is not None and self._held is not None else None
        try:
            buffers = self._buffers(layouts, self.device)
            self._held = receive_round(
                store,
                keys,
                self.identity,
                buffers,
                self.cfg.transport,
                host,
                self.cfg.bucket_timeout_s,
                deadline,
                held,
                signer=info.signer,
            )
        except (RoundSkipped, ws.BucketFailed) as e:
            if isinstance(e, ws.BucketForged) or isinstance(e.__cause__, ws.BucketForged):
                self.count("weights/forged")
                log.error("weight version %d: %s; someone other than the learner wrote to the round", version, e)
            log.info("weight version %d: %s; asking the learner for a catch-up round", version, e)
            if isinstance(e, ws.BucketFailed):
                self._held = None  # retired by receive_round
            caught = self._catch_up(store, keys, version, layouts, host, deadline, info.signer)
            if caught is None:
                return None
            buffers = caught
        named = [
            (s.name, buf[s.offset : s.offset + s.numel].view(s.shape))
            for layout, buf in zip(layouts, buffers)
            for s in layout.slots
        ]
        return Update(version, key, named=named, buffers=buffers)

    def _catch_up(
        self, store: TCPStore, missed: ws.RoundKeys, version: int, layouts, host: str, deadline: float, signer: str
    ) -> list[torch.Tensor] | None:
        """A fresh round of ``version`` from the learner's host copy (gloo, CPU buffers); None if none came."""
        import torch

        tried: set[int] = set()
        for _ in range(2):
            keys = request_catchup(store, missed, version, CATCHUP_WAIT_S, tried, self._newer_queued, signer)
            if keys is None:
                log.warning(
                    "weight version %d: no catch-up round came (sync.catchup off, the learner busy, or a newer "
                    "version announced); going on with the next version",
                    version,
                )
                return None
            tried.add(keys.round_id)
            buffers = self._buffers(layouts, torch.device("cpu"))
            try:
                joined = receive_round(
                    store,
                    keys,
                    self.identity,
                    buffers,
                    "gloo",
                    host,
                    self.cfg.bucket_timeout_s,
                    max(deadline, time.monotonic() + self.cfg.timeout_s),
                    signer=signer,
                )
            except (RoundSkipped, ws.BucketFailed) as e:
                log.info("weight version %d: catch-up round %d: %s", version, keys.round_id, e)
                continue
            ws.retire_group(joined.pg, 0.0)  # a catch-up group is not kept: the next round re-forms
            self.count("weights/catchups")
            return buffers
        return None

    def _newer_queued(self) -> bool:
        with self._cv:
            return self._queued is not None or self._closed

    def _connect(self, addr: tuple[str, int]) -> TCPStore:
        from torch.distributed import TCPStore

        if self._store is None or self._store[0] != addr:
            self._drop_group()
            store = TCPStore(addr[0], addr[1], None, False, timeout=timedelta(seconds=self.cfg.timeout_s))
            self._store = (addr, store)
        return self._store[1]

    def _buffers(self, layouts: list[ws.BucketLayout], device: torch.device) -> list[torch.Tensor]:
        """One flat buffer per bucket; the last applied update's buffers when their layout matches."""
        import torch

        with self._cv:
            spare, self._spare = self._spare, []
        if [(b.numel(), ws.dtype_name(b.dtype), b.device) for b in spare] == [
            (lay.numel, lay.dtype, device) for lay in layouts
        ]:
            return spare
        return [torch.empty(lay.numel, dtype=getattr(torch, lay.dtype), device=device) for lay in layouts]

    def _drop_group(self) -> None:
        if self._held is not None:
            ws.retire_group(self._held.pg, 2 * self.cfg.bucket_timeout_s)
            self._held = None


def buffer_device(transport: str, device: str) -> torch.device:
    """Where received buckets land: the rollout's GPU for nccl, else CPU."""
    import torch

    if transport != "nccl":
        return torch.device("cpu")
    resolved = torch.device("cuda" if device == "auto" else device)
    if resolved.type != "cuda":
        raise ValueError(
            f"sync.transport=nccl needs the rollout on a GPU (rollout.device={device!r}); "
            "use sync.transport=gloo or filesystem for CPU rollouts"
        )
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


__all__ = [
    "RECEIVERS",
    "BroadcastReceiver",
    "FileReceiver",
    "RoundSkipped",
    "Update",
    "WeightReceiver",
    "buffer_device",
]
