"""`WeightPublisher`: learner rank 0 sends each new policy to the rollout fleet (docs/weight_sync.md).

Every learner rank creates one and calls :meth:`WeightPublisher.publish` every ``sync.interval``
steps with the full (gathered) parameters; only rank 0 sends. The transport comes from the
``SENDERS`` registry by ``sync.transport``:

- ``filesystem``: one safetensors file per version, streamed to ``v<version>.tmp-<pid>/`` tensor by
  tensor and renamed to ``v<version>/`` when complete; the newest ``sync.keep_versions`` stay; the
  announcement goes out after the rename.
- ``gloo`` / ``nccl`` (``broadcast.py``): the announcement goes out first, with the round's secret;
  receivers join the round through the TCPStore rank 0 hosts (on ``sync.master_addr`` only), the
  learner forms (or reuses) a process group with them and broadcasts one flat tensor per bucket,
  keeping one bucket in flight while it gathers and packs the next. A receiver that dies or stalls
  costs about one bucket timeout: the others re-form and get the version. Receivers that missed a
  round get a catch-up round from the host copy (``sync.catchup``).

Rank 0 always consumes every tensor of ``params``, even when nothing is sent, so that ranks that
gather ZeRO-3 shards in lockstep with it never wait on it.

**Overlapped rounds** (``sync.overlap``, gloo): :meth:`WeightPublisher.start` copies the weights, runs the
round on a thread of its own and returns as soon as the version is announced, so the learner's next step
runs while receivers join and the buckets stream. The announcement itself stays on the learner's path:
the broker's staleness bound counts from the newest version announced, so no group is trained against a
version the broker does not know yet. The next publish first waits for the round before it (one round
in flight; it costs one copy of the weights in host memory) and reports that round's ``sync/*`` figures.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetrl.common import messages
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, SyncConfig
from fleetrl.common.plugins.registry import Registry
from fleetrl.common.telemetry import tracing
from fleetrl.common.weightsync import fingerprint
from fleetrl.common.weightsync.sender.broadcast import Announce, BroadcastSender, Sent, Tensors

if TYPE_CHECKING:  # torch is imported where it is used: this package imports without it
    import torch

log = logging.getLogger(__name__)

METRIC_KEYS = (
    "timing/sync_s",
    "sync/mb",
    "sync/mb_per_s",
    "sync/receivers",
    "sync/failed",
    "sync/unknown_joiners",
    "sync/reforms",
    "sync/dropped",
    "sync/tampered",
)
KEEP_FPS = 64  # versions whose fingerprints the publisher keeps (a group older than that is not compared)
OVERLAP_TRANSPORTS = ("gloo",)  # nccl would need a second copy of the weights on the GPU; files announce at the end

SENDERS: Registry[type] = Registry("weight transport", config_key="sync.transport")


class WeightPublisher:
    def __init__(self, cfg: JobConfig, run_dir: Path, rank: int, specs: list[messages.ParamSpec]):
        self.cfg = cfg.sync
        self.rank = rank
        self.specs = [ws.make_spec(s.name, s.shape, s.dtype) for s in specs]
        self.plan = ws.plan_buckets(self.specs, int(self.cfg.bucket_mb * ws.MB))
        self._sender = SENDERS[self.cfg.transport](self.cfg, Path(run_dir), self.plan) if rank == 0 else None
        self.overlap = self.cfg.overlap and self.cfg.transport in OVERLAP_TRANSPORTS
        self._background: BackgroundRound | None = None  # the overlapped round in flight (rank 0)
        # version -> fingerprints of the weights published as it (weightsync/fingerprint.py), the newest KEEP_FPS
        self.fingerprints: dict[int, dict[str, str]] = {}

    def publish(
        self,
        version: int,
        step: int,
        params: Iterable[tuple[str, torch.Tensor]],
        announce: Announce,
        expected_receivers: int,
    ) -> dict[str, float]:
        """One sync round (see the module docstring); returns ``sync/*`` metrics (zeros off rank 0)."""
        samples: dict[str, Any] = {}
        it = _tapped(iter(params), samples)
        if self._sender is None:
            _drain(it)
            self._record(version, samples)
            return dict.fromkeys(METRIC_KEYS, 0.0)
        t0 = time.perf_counter()
        attributes = {"fleetrl.policy_version": version, "fleetrl.step": step, "fleetrl.transport": self.cfg.transport}
        try:
            with tracing.span("learner.publish_weights", attributes=attributes) as span:  # child of learner.step
                sent = self._sender.send(version, step, _checked(it, self.specs), announce, expected_receivers)
                span.set_attributes(
                    {
                        "fleetrl.mb": sent.nbytes / ws.MB,
                        "fleetrl.receivers": sent.receivers,
                        "fleetrl.failed": sent.failed,
                    }
                )
        finally:
            extra = _drain(it)
        if extra:
            raise ValueError(
                f"publish: params yielded {extra} tensors beyond the {len(self.specs)} specs; "
                "build the publisher's specs from the same named_parameters() that publish() iterates"
            )
        self._record(version, samples)
        return sent_metrics(sent, time.perf_counter() - t0)

    def _record(self, version: int, samples: dict[str, Any]) -> None:
        if samples:
            self.fingerprints[version] = fingerprint.fingerprints(samples)
        for old in sorted(self.fingerprints)[:-KEEP_FPS]:
            del self.fingerprints[old]

    def start(
        self,
        version: int,
        step: int,
        params: Iterable[tuple[str, torch.Tensor]],
        announce: Announce,
        expected_receivers: int,
    ) -> dict[str, float]:
        """An overlapped round (module docstring): returns once ``version`` is announced. Without
        ``overlap`` (or off rank 0) it is `publish`. The ``sync/*`` figures are those of the round before
        (none after the first); ``timing/sync_s`` is what this call took (waiting for that round, the copy,
        the announcement) and ``sync/round_s`` how long that round ran beside training."""
        if not self.overlap or self._sender is None:
            return self.publish(version, step, params, announce, expected_receivers)
        t0 = time.perf_counter()
        previous = self.wait()
        samples: dict[str, Any] = {}
        it = _tapped(iter(params), samples)
        try:
            copy = [
                (spec, tensor.detach().clone()) for spec, tensor in _checked(it, self.specs)
            ]  # before the next step
        finally:
            extra = _drain(it)
        if extra:
            raise ValueError(
                f"publish: params yielded {extra} tensors beyond the {len(self.specs)} specs; "
                "build the publisher's specs from the same named_parameters() that publish() iterates"
            )
        self._record(version, samples)
        sender = self._sender
        attributes = {
            "fleetrl.policy_version": version,
            "fleetrl.step": step,
            "fleetrl.transport": self.cfg.transport,
            "fleetrl.overlap": True,
        }
        with tracing.span("learner.publish_weights", attributes=attributes):  # until announced: the rest overlaps
            round_ = BackgroundRound(
                lambda say: sender.send(version, step, iter(copy), say, expected_receivers),
                announce,
                f"fleetrl-publish-v{version}",
            )
            round_.announced()  # raises what the round raised before announcing (the broker is gone...): it is over
        self._background = round_
        out = sent_metrics(previous[0], previous[1]) if previous is not None else {}
        if previous is not None:
            out["sync/round_s"] = out.pop("timing/sync_s")
        out["timing/sync_s"] = time.perf_counter() - t0
        return out

    def wait(self) -> tuple[Sent, float] | None:
        """Wait for the overlapped round in flight, if any: (what it sent, its seconds); raises what it raised."""
        bg, self._background = self._background, None
        return bg.result() if bg is not None else None

    def close(self) -> None:
        try:
            self.wait()  # the last version reaches the fleet before the sender goes
        finally:
            if self._sender is not None:
                self._sender.close()
                self._sender = None


class BackgroundRound:
    """One publish round on a thread of its own (`WeightPublisher.start`): ``run(announce)`` returns `Sent`.

    `announced` blocks until the round has announced its version, or raises what the round raised before
    it could; `result` joins the thread and returns (sent, seconds), or raises what the round raised."""

    def __init__(self, run: Callable[[Announce], Sent], announce: Announce, name: str):
        self._announce, self._said = announce, threading.Event()
        self._told = False  # the announcement went out
        self._sent: Sent | None = None
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(run,), name=name, daemon=True)
        self._thread.start()

    def _say(self, info: messages.WeightsInfo) -> None:
        self._announce(info)
        self._told = True
        self._said.set()

    def _run(self, run: Callable[[Announce], Sent]) -> None:
        t0 = time.perf_counter()
        try:
            self._sent = run(self._say)
        except BaseException as e:  # noqa: BLE001 - handed to the learner's thread, which raises it
            self._error = e
        finally:
            self._seconds = time.perf_counter() - t0
            self._said.set()

    def announced(self) -> None:
        self._said.wait()
        if not self._told:
            self._thread.join()
            raise self._error if self._error is not None else RuntimeError("the publish round never announced")

    def result(self) -> tuple[Sent, float]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._sent is not None
        return self._sent, self._seconds


def sent_metrics(sent: Sent, seconds: float) -> dict[str, float]:
    """The ``sync/*`` figures of one round (``timing/sync_s``: ``seconds``)."""
    mb = sent.nbytes / ws.MB
    return {
        "timing/sync_s": seconds,
        "sync/mb": mb,
        "sync/mb_per_s": mb / sent.seconds if sent.seconds > 0 else 0.0,
        "sync/receivers": float(sent.receivers),
        "sync/failed": float(sent.failed),
        "sync/unknown_joiners": float(sent.unknown_joiners),
        "sync/reforms": float(sent.reforms),
        "sync/dropped": float(sent.dropped),
        "sync/tampered": float(sent.tampered),
    }


def _checked(it: Iterator[tuple[str, torch.Tensor]], specs: list[messages.ParamSpec]) -> Tensors:
    """Pair each yielded tensor with its spec; a name or shape that differs is a learner bug."""
    for spec in specs:
        item = next(it, None)
        if item is None:
            raise ValueError(f"publish: params ended before {spec.name!r}; it must yield every spec in order")
        name, tensor = item
        if name != spec.name or list(tensor.shape) != spec.shape:
            raise ValueError(
                f"publish: expected {spec.name!r} {spec.shape}, got {name!r} {list(tensor.shape)}; "
                "params must yield exactly the specs, in the same order"
            )
        yield spec, tensor


def _tapped(it: Iterator[tuple[str, torch.Tensor]], samples: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as it is, each floating tensor's fingerprint sample kept in ``samples`` on the way."""
    for name, tensor in it:
        if tensor.is_floating_point():
            samples[name] = fingerprint.sample(tensor)
        yield name, tensor


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
        import torch

        t0 = time.perf_counter()
        final = self.root / ws.version_dir(version)
        tmp = self.root / f".{ws.version_dir(version)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.mkdir(mode=0o700)  # weights are owner-only: directory 0700, file 0600
        header = ws.safetensors_header(self.specs, {"format": "pt", "version": str(version), "step": str(step)})
        try:
            with open(tmp / ws.WEIGHTS_FILE, "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as f:
                f.write(header)
                for spec, tensor in tensors:
                    data = tensor.detach().to("cpu", getattr(torch, spec.dtype)).contiguous().reshape(-1)
                    f.write(data.view(torch.uint8).numpy().data)
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

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- broadcast

SENDERS.register("gloo", "nccl")(BroadcastSender)  # common/weightsync/sender/broadcast.py
