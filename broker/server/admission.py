"""Admission: how many groups may exist at once (queued, being generated, being trained), and how many
the broker holds at most (``broker.max_held_groups``, ``broker.max_held_bytes``), and what one lease may
weigh (``broker.max_lease_bytes``).

The capacity is ``broker.queue_capacity`` when set, else measured from what the learner consumes
(``broker.admission: measured``, ``staleness.MeasuredCapacity``) or the static bound of
``staleness.admission_capacity``. The load it bounds is counted from the queue, the open prompt leases
and the groups in learners' hands.
"""

from __future__ import annotations

import math

from fleetrl.broker.server.leases import BatchLeases
from fleetrl.broker.server.prompts import PromptSource
from fleetrl.broker.server.queue import GroupQueue
from fleetrl.broker.server.staleness import MeasuredCapacity, admission_capacity, held_bytes_budget
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
        self.max_held_bytes = held_bytes_budget(cfg, self.fixed_capacity * (8 if self.measured else 1))
        self.max_lease_bytes = bcfg.max_lease_bytes or self.max_held_bytes  # what one lease's frame may weigh

    @property
    def capacity(self) -> int:
        """Most groups queued + generating + training (broker.queue_capacity, else measured or static)."""
        return self.measured.capacity if self.measured is not None else self.fixed_capacity

    def room(self, lag: int = 0, ahead: int = 0) -> int:
        """Groups a rollout whose weights are ``lag`` versions behind may still be granted (issue 24).

        Measured, the window holds only work that can still be trained. It shrinks with the lag
        (`MeasuredCapacity.capacity_at`): those groups are already ``lag`` old. And it runs from the start of
        the version learners train now: what they have taken at it (kept groups in flight, filtered ones
        acknowledged at once, a step trained whose next version is not published yet; at most a version's
        share) has used its part, and groups queued now are trained after it. Counted as the kept groups in
        flight only, the window's tail was generated to be dropped as stale (quiet demo, main 9dad667: 18%
        of the groups made, in bursts of ~20 when a version was published).

        ``ahead`` (1 while learners lease ahead of their publish, learner.prefetch): what is made now is trained
        a version later, so the window is one version shorter; for weights on the newest version it keeps two
        (the version the lease ahead takes its share of, and one more), or a learner whose lease ahead took its
        whole share in filtered groups would wait for groups no rollout may make."""
        if self.measured is None:
            return self.fixed_capacity - self.load()
        this_version = max(self.batches.in_flight, min(self.measured.taken, math.ceil(round(self.measured.per, 6))))
        least = 1 + ahead if lag == 0 else 1
        return self.measured.capacity_at(lag + ahead, least) - (len(self.q) + self.prompts.leased + this_version)

    def load(self) -> int:
        """Groups queued, being generated, or being trained: what admission control bounds."""
        return len(self.q) + self.prompts.leased + self.batches.in_flight
