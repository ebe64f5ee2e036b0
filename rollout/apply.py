"""Weight application for one rollout server: which version the engine holds, and loading new ones in flight.

Every version announcement goes to the weight receiver (which orders versions by publish time, so a
rollback's older version still counts as new). When the receiver holds a complete version, `apply` pauses
the engine as ``rollout.inflight_update`` says, loads it and resumes; the tokens sampled after carry the
new version. A load whose names, shapes or dtypes do not fit changes nothing, and the engine keeps
generating with the version it has.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleetrl.common import faults
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry import tracing
from fleetrl.rollout.tracing import trace_load

if TYPE_CHECKING:
    from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

log = logging.getLogger("fleetrl.rollout")


class WeightApplier:
    def __init__(
        self,
        cfg: JobConfig,
        engine: Any,
        receiver: WeightReceiver | None,
        on_loaded: Callable[[int], None] = lambda version: None,
    ):
        self.cfg, self.engine, self.receiver, self.on_loaded = cfg, engine, receiver, on_loaded
        self.version = 0  # the weights the engine holds: model.path until a new version is applied
        self.stats = {"weights/pause_ms": 0.0, "weights/updates_inflight": 0.0}
        self._announced: dict[int, list[dict[str, str]]] = {}  # version -> the publish spans it was announced with
        self._warned_no_receiver = False
        # [version, dtype, names, fp] of the weights the engine holds, read back after each load (None before the
        # first: the learner publishes no version 0); every group carries it (metadata "weights_fp")
        self.fingerprint: list[Any] | None = None

    def offer(self, version: int, weights: m.WeightsInfo) -> None:
        """An announced (or caught-up) version, for the receiver to fetch."""
        if weights.traces and tracing.enabled():  # the group traces this version's load joins (rollout/tracing.py)
            self._announced = {v: t for v, t in self._announced.items() if v > version - 8}
            self._announced[version] = weights.traces
        if self.receiver is None:
            if version != self.version and not self._warned_no_receiver:
                log.warning(
                    "policy version %d announced but this server has no weight receiver; it keeps "
                    "generating with version %d",
                    version,
                    self.version,
                )
                self._warned_no_receiver = True
            return
        self.receiver.on_version(version, weights)

    def apply(self, in_flight: int) -> int | None:
        """Load the receiver's complete version, if it holds one; returns the new version (None: none loaded)."""
        if self.receiver is None or self.receiver.pending_version() is None:
            return None
        start_ns, t0 = time.time_ns(), time.perf_counter()
        load = functools.partial(
            faults.at("rollout.weight_load", self.receiver.apply, pending=self.receiver.pending_version, owner=self),
            self.engine,
        )
        try:
            version = self.engine.loop.call(self.engine.swap_weights(load, self.cfg.rollout.inflight_update))
        except ValueError as e:  # names, shapes or dtypes that do not fit: the engine changed nothing
            log.error("could not load new weights (%s); generating with version %d until the next one", e, self.version)
            return None
        pause_ms = 1000 * (time.perf_counter() - t0)
        if version is None or version == self.version:
            return None
        trace_load(
            start_ns,
            self._announced.pop(version, []),
            {
                "fleetrl.policy_version": version,
                "fleetrl.previous_version": self.version,
                "fleetrl.inflight_update": self.cfg.rollout.inflight_update,
                "fleetrl.in_flight": in_flight,
            },
        )
        log.info(
            "policy version %d -> %d: new weights loaded in flight (%s, %d groups in flight, paused %.0f ms)",
            self.version,
            version,
            self.cfg.rollout.inflight_update,
            in_flight,
            pause_ms,
        )
        self.version = version
        held = self.engine.weights_fingerprint()
        self.fingerprint = [version, *held] if held is not None else None
        faults.at("rollout.version_loaded", version)
        self.stats["weights/pause_ms"] = pause_ms
        self.stats["weights/updates_inflight"] += 1
        self.on_loaded(version)
        return version

    def metrics(self) -> dict[str, float]:
        """The receiver's counters and the last in-flight update's pause."""
        return {**(self.receiver.stats() if self.receiver is not None else {}), **self.stats}
