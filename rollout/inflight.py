"""What the streaming loop keeps per admitted prompt, and its in-flight budget (rollout/server.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.rollout.engines.base import Generation
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
    ``broker/staleness.py: admission_capacity``: groups trained per version x the versions a group may
    lag, plus the current one). More would only wait for the broker's throttle."""
    if cfg.rollout.max_inflight is not None:
        return cfg.rollout.max_inflight
    return cfg.learner.groups_per_step * cfg.sync.interval * (cfg.broker.max_staleness + 1)


def trace_carrier(trace: LeaseTrace | None, prompt_id: str) -> dict[str, str] | None:
    """The W3C context of a prompt's span, for the engine's requests (None when tracing is off)."""
    return trace.carrier(prompt_id) if trace is not None else None
