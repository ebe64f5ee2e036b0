"""Where a learner rank's batches come from: batch leases from the broker (or its in-process twin).

Each rank leases its share of ``learner.groups_per_step``. With DAPO's dynamic sampling, groups whose
rewards are all equal carry no gradient: they are filtered out and the rank keeps leasing — at most
``learner.max_lease_rounds`` leases per step — until its share is full. Every leased group (kept or
filtered) is acknowledged after the optimizer step, so the broker neither redelivers nor loses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fleetrl.broker.client.roles import LearnerClient
from fleetrl.common import faults
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import dynamic_sampling_filter

log = logging.getLogger(__name__)


class FleetIdle(RuntimeError):
    """No groups arrived within learner.batch_wait_s."""


class Interrupted(Exception):
    """A stop was requested while waiting for groups (nothing was leased for this step)."""


@dataclass
class Leased:
    """What a source hands the learner for one step: leased groups, or (offline DPO) preference pairs."""

    groups: list[m.SampleGroup]  # kept for training
    leases: list[tuple[str, list[str]]] = field(default_factory=list)  # (lease id, group ids to ack after the step)
    filtered: int = 0  # groups dropped by dynamic sampling
    filtered_ids: list[str] = field(default_factory=list)  # their ids (acked, not trained: trained-<rank>.jsonl)
    dropped_stale: int = 0
    wait_s: float = 0.0
    pairs: list[tuple[list[int], list[int], list[int]]] | None = None  # offline DPO: (prompt, chosen, rejected) ids
    pair_ids: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        """The ids of what this step trains on (group ids, or pair ids offline), for the trained log."""
        return list(self.pair_ids) if self.pairs is not None else [g.group_id for g in self.groups]


def share_of(total: int, rank: int, world: int) -> int:
    """This rank's part of ``total`` groups (the first ``total % world`` ranks take one more)."""
    return total // world + (1 if rank < total % world else 0)


class BrokerBatchSource:
    def __init__(self, client: LearnerClient, cfg: JobConfig, rank: int, world: int):
        self.client, self.cfg = client, cfg
        self.want = max(1, share_of(cfg.learner.groups_per_step, rank, world))
        self.dynamic = cfg.algorithm.dynamic_sampling
        self.filtered_total = 0

    def _lease(self, n: int, deadline: float, should_stop: Callable[[], bool]) -> m.BatchLease:
        while True:
            if should_stop():
                raise Interrupted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise FleetIdle(
                    f"no groups arrived within learner.batch_wait_s={self.cfg.learner.batch_wait_s:g} s; "
                    "check that rollout servers run (`fleetrl status --broker ADDR`) or raise that setting"
                )
            reply = self.client.lease_batch(n, wait_s=min(2.0, left), min_groups=n)
            if isinstance(reply, m.BatchLease):
                return reply
            time.sleep(min(reply.retry_after_s, max(0.0, deadline - time.monotonic())))

    def next(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> Leased:
        """This rank's groups for training step ``step`` (1-based)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.learner.batch_wait_s
        out = Leased(groups=[])
        for _ in range(self.cfg.learner.max_lease_rounds if self.dynamic else 1):
            need = self.want - len(out.groups)
            lease = self._lease(need, deadline, should_stop)
            out.dropped_stale += lease.dropped_stale
            kept = self._filter(lease.groups) if self.dynamic else lease.groups
            kept_ids = {g.group_id for g in kept}
            filtered = [g.group_id for g in lease.groups if g.group_id not in kept_ids]
            if filtered:
                # done with them now: they would otherwise hold admission capacity while the rank keeps leasing
                self.client.ack_batch(lease.lease_id, filtered, step, keep_rest=bool(kept))
            if kept:
                out.leases.append((lease.lease_id, [g.group_id for g in kept]))
            out.filtered += len(filtered)
            out.filtered_ids.extend(filtered)
            out.groups.extend(kept)
            last = lease
            if len(out.groups) >= self.want:
                break
        if not out.groups:  # every group was filtered: train on what came rather than not at all
            log.warning(
                "dynamic sampling filtered every group of %d leases; training on the last lease", len(out.leases)
            )
            out.groups = list(last.groups)
        self.filtered_total += out.filtered
        out.wait_s = time.monotonic() - t0
        return out

    @staticmethod
    def _filter(groups: list[m.SampleGroup]) -> list[m.SampleGroup]:
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rewards])
        keep, _ = dynamic_sampling_filter(rewards, index)
        kept_groups = {int(i) for i in index[keep]}
        return [g for i, g in enumerate(groups) if i in kept_groups]

    def ack(self, leased: Leased, step: int) -> None:
        faults.at("learner.step")  # a chaos run pins here: trained, not acknowledged yet
        for lease_id, group_ids in leased.leases:
            self.client.ack_batch(lease_id, group_ids, step)

    def state_dict(self) -> dict[str, int]:
        """Nothing to save: the broker keeps the data cursor (see broker.commit_on_checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass
