"""What the streaming loop keeps per admitted prompt, and its in-flight budget (rollout/server.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.tracing import LeaseTrace


@dataclass
class InFlight:
    """One admitted prompt: its ``group_size`` requests in the engine and the samples done so far."""

    lease: m.PromptLease
    prompt: m.Prompt
    prompt_ids: list[int]
    version: int  # the engine's version at admission
    started: float
    trace: LeaseTrace | None
    samples: list[Generation | None] = field(default_factory=list)
    failed: BaseException | None = None

    @property
    def done(self) -> bool:
        return all(s is not None for s in self.samples)


def max_inflight(cfg: JobConfig) -> int:
    """``rollout.max_inflight``, by default the broker's admission window in groups (the formula of
    ``broker/server/staleness.py: admission_capacity``: groups trained per version x the versions a group may
    lag, plus the current one). More would only wait for the broker's throttle."""
    if cfg.rollout.max_inflight is not None:
        return cfg.rollout.max_inflight
    return cfg.learner.groups_per_step * cfg.sync.interval * (cfg.broker.max_staleness + 1)


class InflightBudget:
    """The rollout side of admission: prompts admitted and not yet pushed or given back, bounded by
    ``rollout.max_inflight`` (thread-safe: the finisher's thread gives room back)."""

    def __init__(self, cfg: JobConfig):
        self.most, self.per_lease = max_inflight(cfg), cfg.rollout.prompts_per_batch
        self.unpushed = 0
        self._lock = threading.Lock()

    def room(self) -> int:
        with self._lock:
            return max(0, self.most - self.unpushed)

    def lease_floor(self) -> int:
        """Lease only when at least this many prompts fit (half a lease), or when nothing is in flight."""
        with self._lock:
            busy = self.unpushed > 0
        return max(1, min(self.per_lease, self.most) // 2) if busy else 1

    def admitted(self, n: int = 1) -> None:
        with self._lock:
            self.unpushed += n

    def released(self, n: int = 1) -> None:
        with self._lock:
            self.unpushed -= n


def trace_carrier(trace: LeaseTrace | None, prompt_id: str) -> dict[str, str] | None:
    """The W3C context of a prompt's span, for the engine's requests (None when tracing is off)."""
    return trace.carrier(prompt_id) if trace is not None else None
