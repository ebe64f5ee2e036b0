"""`WeightPublisher`: learner rank 0 sends each new policy to the rollout fleet (docs/weight_sync.md).

Every learner rank creates one and calls :meth:`WeightPublisher.publish` every ``sync.interval``
steps with the full (gathered) parameters; only rank 0 sends. The transport comes from the
``SENDERS`` registry by ``sync.transport``:

- ``filesystem``: one safetensors file per version, streamed to ``v<version>.tmp-<pid>/`` tensor by
  tensor and renamed to ``v<version>/`` when complete; the newest ``sync.keep_versions`` stay; the
  announcement goes out after the rename.
- ``gloo`` / ``nccl``: the announcement goes out first; receivers join the round through the
  TCPStore rank 0 hosts, the learner forms (or reuses) a process group with them and broadcasts one
  flat tensor per bucket, keeping one bucket in flight while it gathers and packs the next. A
  receiver that dies or stalls fails the round, not the learner: the group is dropped, the error
  logged, and the next round forms a new group with whoever joins.

Rank 0 always consumes every tensor of ``params``, even when nothing is sent, so that ranks that
gather ZeRO-3 shards in lockstep with it never wait on it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.distributed import PrefixStore, TCPStore

from fleetrl.common import messages, telemetry
from fleetrl.common import weightsync as ws
from fleetrl.common.registry import Registry
from fleetrl.common.config.schema import JobConfig, SyncConfig

log = logging.getLogger(__name__)

Announce = Callable[[messages.WeightsInfo], None]
Tensors = Iterator[tuple[messages.ParamSpec, torch.Tensor]]
METRIC_KEYS = ("timing/sync_s", "sync/mb", "sync/mb_per_s", "sync/receivers", "sync/failed")

SENDERS: Registry[type] = Registry("weight transport", config_key="sync.transport")


@dataclass
class Sent:
    """What one sender did in a round: bytes sent (or written), seconds it took, receivers reached."""

    nbytes: int = 0
    seconds: float = 0.0
    receivers: int = 0
    failed: bool = False


class WeightPublisher:
    def __init__(self, cfg: JobConfig, run_dir: Path, rank: int, specs: list[messages.ParamSpec]):
        self.cfg = cfg.sync
        self.rank = rank
        self.specs = [ws.make_spec(s.name, s.shape, s.dtype) for s in specs]
        self.plan = ws.plan_buckets(self.specs, int(self.cfg.bucket_mb * ws.MB))
        self._sender = SENDERS[self.cfg.transport](self.cfg, Path(run_dir), self.plan) if rank == 0 else None

    def publish(self, version: int, step: int, params: Iterable[tuple[str, torch.Tensor]], announce: Announce,
                expected_receivers: int) -> dict[str, float]:
        """One sync round (see the module docstring); returns ``sync/*`` metrics (zeros off rank 0)."""
        it = iter(params)
        if self._sender is None:
            _drain(it)
            return dict.fromkeys(METRIC_KEYS, 0.0)
        t0 = time.perf_counter()
        attributes = {"fleetrl.policy_version": version, "fleetrl.step": step, "fleetrl.transport": self.cfg.transport}
        try:
            with telemetry.span("weights.publish", attributes=attributes) as span:  # a child of the learner step
                sent = self._sender.send(version, step, _checked(it, self.specs), announce, expected_receivers)
                span.set_attributes({"fleetrl.mb": sent.nbytes / ws.MB, "fleetrl.receivers": sent.receivers,
                                    "fleetrl.failed": sent.failed})
        finally:
            extra = _drain(it)
        if extra:
            raise ValueError(f"publish: params yielded {extra} tensors beyond the {len(self.specs)} specs; "
                             "build the publisher's specs from the same named_parameters() that publish() iterates")
        mb = sent.nbytes / ws.MB
        return {
            "timing/sync_s": time.perf_counter() - t0,
            "sync/mb": mb,
            "sync/mb_per_s": mb / sent.seconds if sent.seconds > 0 else 0.0,
            "sync/receivers": float(sent.receivers),
            "sync/failed": float(sent.failed),
        }

    def late_receivers(self) -> int:
        """Receivers that tried to join the latest round after it closed (0 off rank 0 and for files, whose
        receivers catch up from the announced directory on their own)."""
        return self._sender.late_receivers() if self._sender is not None else 0

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


def _checked(it: Iterator[tuple[str, torch.Tensor]], specs: list[messages.ParamSpec]) -> Tensors:
    """Pair each yielded tensor with its spec; a name or shape that differs is a learner bug."""
    for spec in specs:
        item = next(it, None)
        if item is None:
            raise ValueError(f"publish: params ended before {spec.name!r}; it must yield every spec in order")
        name, tensor = item
        if name != spec.name or list(tensor.shape) != spec.shape:
            raise ValueError(f"publish: expected {spec.name!r} {spec.shape}, got {name!r} {list(tensor.shape)}; "
                             "params must yield exactly the specs, in the same order")
        yield spec, tensor


def _drain(it: Iterator[Any]) -> int:
    return sum(1 for _ in it)


def _take(tensors: Tensors, n: int) -> list[torch.Tensor]:
    return [next(tensors)[1] for _ in range(n)]


# ------------------------------------------------------------------------------ filesystem


@SENDERS.register("filesystem")
class FileSender:
    """Streams each version into ``<dir>/v<version>/model.safetensors`` (tmp dir + rename)."""

    def __init__(self, cfg: SyncConfig, run_dir: Path, plan: list[list[messages.ParamSpec]]):
        self.cfg = cfg
        self.root = Path(cfg.dir) if cfg.dir else run_dir / "weights"
        self.specs = [s for bucket in plan for s in bucket]

    def send(self, version: int, step: int, tensors: Tensors, announce: Announce, expected: int) -> Sent:
        t0 = time.perf_counter()
        final = self.root / ws.version_dir(version)
        tmp = self.root / f".{ws.version_dir(version)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        header = ws.safetensors_header(self.specs, {"format": "pt", "version": str(version), "step": str(step)})
        try:
            with open(tmp / ws.WEIGHTS_FILE, "wb") as f:
                f.write(header)
                for spec, tensor in tensors:
                    data = tensor.detach().to("cpu", getattr(torch, spec.dtype)).contiguous().reshape(-1)
                    f.write(memoryview(data.view(torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # re-published version (e.g. after a rollback): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        seconds = time.perf_counter() - t0
        self._prune()
        announce(messages.WeightsInfo(transport="filesystem", path=str(final), published_at=time.time()))
        return Sent(nbytes=ws.plan_bytes([self.specs]), seconds=seconds)

    def _prune(self) -> None:
        for name in ws.versions_to_prune([p.name for p in self.root.iterdir()], self.cfg.keep_versions):
            shutil.rmtree(self.root / name, ignore_errors=True)

    def late_receivers(self) -> int:
        return 0

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- broadcast


@dataclass
class _Group:
    id: str
    size: int
    ranks: dict[str, int]  # identity -> rank
    pg: Any


@SENDERS.register("gloo", "nccl")
class BroadcastSender:
    """Hosts the round TCPStore, forms or reuses the group, broadcasts the buckets (module docstring)."""

    def __init__(self, cfg: SyncConfig, run_dir: Path, plan: list[list[messages.ParamSpec]]):
        self.cfg = cfg
        self.plan = plan
        self.layouts = [ws.bucket_layout(b) for b in plan]
        nccl = cfg.transport == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._store: TCPStore | None = None
        self._group: _Group | None = None
        self._round = 0
        self._round_keys: dict[int, list[str]] = {}  # member records and plan of recent rounds
        self._joined = 0  # receivers counted in when the latest round closed
        # gloo: two CPU staging buffers of the largest bucket, one being sent while the next is packed
        # (fresh pages cost ~5x the copy itself); nccl: CUDA's caching allocator already reuses memory.
        self._staging: list[torch.Tensor] = []
        if self.device.type == "cpu" and self.layouts:
            self._staging = [torch.empty(max(lay.nbytes for lay in self.layouts), dtype=torch.uint8) for _ in range(2)]

    @property
    def port(self) -> int:
        return self._store.port if self._store is not None else 0

    def send(self, version: int, step: int, tensors: Tensors, announce: Announce, expected: int) -> Sent:
        store = self._ensure_store()
        self._round += 1
        round_id = self._round
        for key in self._round_keys.pop(round_id - 2, []):  # every receiver of that round has read them
            store.delete_key(key)
        deadline = time.monotonic() + self.cfg.timeout_s
        announce(messages.WeightsInfo(transport=self.cfg.transport, published_at=time.time(), master_addr=self.cfg.master_addr,
                                      master_port=self.port, buckets=self.plan, round_id=round_id))
        group, members = None, []
        try:
            members = self._close_round(store, round_id, expected, deadline)
            if members:
                group = self._group_for(store, round_id, members, deadline)
        except Exception as e:  # noqa: BLE001 - a receiver must never crash the learner
            log.warning("weight sync round %d (version %d): could not form the group (%s); rollouts keep their "
                        "weights until the next round", round_id, version, e)
            self._drop_group()
        t0 = time.perf_counter()
        ok = self._stream(group, tensors, deadline, round_id)
        seconds = time.perf_counter() - t0
        if group is None:
            return Sent(failed=bool(members))
        if not ok:
            return Sent(seconds=seconds, failed=True)
        return Sent(nbytes=sum(lay.nbytes for lay in self.layouts), seconds=seconds, receivers=group.size - 1)

    def _ensure_store(self) -> TCPStore:
        if self._store is None:
            self._store = TCPStore(self.cfg.master_addr, self.cfg.master_port, None, True,
                                   timeout=timedelta(seconds=self.cfg.timeout_s), wait_for_workers=False)
            log.info("weight sync: %s rounds on TCPStore %s:%d", self.cfg.transport, self.cfg.master_addr,
                     self._store.port)
        return self._store

    def _close_round(self, store: TCPStore, round_id: int, expected: int, deadline: float) -> list[messages.JoinRecord]:
        """Wait for ``expected`` joins (at most JOIN_WINDOW_S), close the round, read who joined."""
        window_end = min(time.monotonic() + ws.JOIN_WINDOW_S, deadline)
        while expected > 0 and store.add(ws.count_key(round_id), 0) < expected and time.monotonic() < window_end:
            time.sleep(0.005)
        joined = store.add(ws.count_key(round_id), ws.CLOSED) - ws.CLOSED
        self._joined = joined
        keys = [ws.member_key(round_id, n) for n in range(1, joined + 1)]
        self._round_keys[round_id] = keys + [ws.plan_key(round_id)]  # the count key stays: it marks the round closed
        if keys:
            try:
                store.wait(keys, timedelta(seconds=max(0.1, min(2.0, deadline - time.monotonic()))))
            except Exception:  # noqa: BLE001 - a receiver died between joining and writing its record
                pass
        members = [messages.decode_join(store.get(k)) for k in keys if store.check([k])]
        if joined and len(members) < joined:
            log.warning("weight sync round %d: %d receivers joined but only %d wrote their record", round_id, joined,
                        len(members))
        if joined and not members:
            store.set(ws.plan_key(round_id), messages.encode_record(messages.RoundPlan(group="", size=1, ranks={})))
        return members

    def _group_for(self, store: TCPStore, round_id: int, members: list[messages.JoinRecord], deadline: float) -> _Group:
        """The previous group when the same members hold it, else a new one (published in the plan)."""
        prev = self._group
        idents = list(dict.fromkeys(m.identity for m in members))
        if prev is not None and set(idents) == set(prev.ranks) and all(m.group == prev.id for m in members):
            plan = messages.RoundPlan(group=prev.id, size=prev.size, ranks=prev.ranks, reuse=True)
            store.set(ws.plan_key(round_id), messages.encode_record(plan))
            return prev
        self._drop_group()
        ranks = {ident: i for i, ident in enumerate(idents, start=1)}
        plan = messages.RoundPlan(group=str(round_id), size=len(ranks) + 1, ranks=ranks)
        store.set(ws.plan_key(round_id), messages.encode_record(plan))
        pg = ws.new_group(self.cfg.transport, PrefixStore(ws.group_prefix(plan.group), store), 0, plan.size,
                          deadline - time.monotonic(), self.cfg.master_addr)
        self._group = _Group(plan.group, plan.size, ranks, pg)
        log.info("weight sync: new %s group %s with %d receivers", self.cfg.transport, plan.group, len(ranks))
        return self._group

    def _stream(self, group: _Group | None, tensors: Tensors, deadline: float, round_id: int) -> bool:
        """Pack and broadcast each bucket, one in flight while the next is gathered and packed.
        Consumes every tensor whatever happens; returns False when the round failed."""
        inflight = None  # (work, flat) of the bucket being sent
        failed = group is None
        for i, layout in enumerate(self.layouts):
            chunk = _take(tensors, len(layout.slots))
            if failed:
                continue
            flat = self._pack(layout, chunk, i % 2)
            try:
                if inflight is not None:
                    ws.wait(inflight[0], deadline - time.monotonic())
                inflight = (ws.broadcast(group.pg, flat, deadline - time.monotonic()), flat)
            except Exception as e:  # noqa: BLE001 - a receiver died or stalled
                failed = self._fail(round_id, e)
        if inflight is not None and not failed:
            try:
                ws.wait(inflight[0], deadline - time.monotonic())
            except Exception as e:  # noqa: BLE001
                failed = self._fail(round_id, e)
        return not failed

    def late_receivers(self) -> int:
        """Join attempts on the latest round after it closed: a receiver that is too late adds 1 to the round's
        counter (see ``RoundSkipped`` in rollout/weights.py) and waits for the next round, which only a new
        publish starts."""
        if self._store is None or self._round == 0:
            return 0
        return max(0, self._store.add(ws.count_key(self._round), 0) - ws.CLOSED - self._joined)

    def _pack(self, layout: ws.BucketLayout, chunk: list[torch.Tensor], parity: int) -> torch.Tensor:
        """The bucket's tensors copied back to back into one flat tensor. Always a copy: under ZeRO-3
        a gathered tensor's storage may be released as soon as the next one is yielded."""
        dtype = getattr(torch, layout.dtype)
        if self._staging:
            flat = self._staging[parity][: layout.nbytes].view(dtype)
        else:
            flat = torch.empty(layout.numel, dtype=dtype, device=self.device)
        for slot, tensor in zip(layout.slots, chunk):
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.detach().reshape(-1))
        return flat

    def _fail(self, round_id: int, error: Exception) -> bool:
        log.warning("weight sync round %d failed (%s: %s); dropping the group, the next round forms a new one",
                    round_id, type(error).__name__, str(error).splitlines()[0][:300])
        self._drop_group()
        return True

    def _drop_group(self) -> None:
        if self._group is not None:
            ws.release_group(self._group.pg)
            self._group = None

    def close(self) -> None:
        self._drop_group()
        self._store = None
        self._staging = []
