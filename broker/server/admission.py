"""Admission: how many groups may exist at once (queued, being generated, being trained), and how many
the broker holds at most (``broker.max_held_groups``).

The capacity is ``broker.queue_capacity`` when set, else measured from what the learner consumes
(``broker.admission: measured``, ``staleness.MeasuredCapacity``) or the static bound of
``staleness.admission_capacity``. The load it bounds is counted from the queue, the open prompt leases
and the groups in learners' hands.
"""

from __future__ import annotations

from fleetrl.broker.server.leases import BatchLeases
from fleetrl.broker.server.prompts import PromptSource
from fleetrl.broker.server.queue import GroupQueue
from fleetrl.broker.server.staleness import MeasuredCapacity, admission_capacity
from fleetrl.common.config.schema import JobConfig


class Admission:
    def __init__(self, cfg: JobConfig, q: GroupQueue, prompts: PromptSource, batches: BatchLeases):
        bcfg = cfg.broker
        self.q, self.prompts, self.batches = q, prompts, batches
        static = admission_capacity(cfg.learner.groups_per_step, cfg.sync.interval, bcfg.max_staleness)
        self.measured = (
            MeasuredCapacity(cfg.learner.groups_per_step * cfg.sync.interval, bcfg.max_staleness)
            if bcfg.queue_capacity is None and bcfg.admission == "measured"
            else None
        )
        self.fixed_capacity = bcfg.queue_capacity or static
        self.max_held = bcfg.max_held_groups or max(16 * self.fixed_capacity * (8 if self.measured else 1), 10_000)

    @property
    def capacity(self) -> int:
        """Most groups queued + generating + training (broker.queue_capacity, else measured or static)."""
        return self.measured.capacity if self.measured is not None else self.fixed_capacity

    def load(self) -> int:
        """Groups queued, being generated, or being trained: what admission control bounds."""
        return len(self.q) + self.prompts.leased + self.batches.in_flight
