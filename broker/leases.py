"""The learner half of the broker's protocol: batch leases, acknowledgements, commits and rewinds.

A learner leases a batch of queued groups (stale ones are dropped as they are handed out, so the
check costs O(batch), not O(queue)), then acknowledges the groups it trained. Without
``broker.commit_on_checkpoint`` an acknowledged group is forgotten at once; with it, the group is kept
until a ``Commit`` at a checkpoint covers its step, and a ``Rewind`` after a resume puts everything
trained past that checkpoint back at the front of the queue, in order. A batch lease that is not
acknowledged within ``broker.batch_lease_s`` is redelivered the same way.

``BatchLeasing`` is a mixin of :class:`~fleetrl.broker.state.BrokerState`: it keeps no state of its
own and works on the broker's queue, groups, counters and spool through the attributes and helpers
listed on the class.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetrl.broker import spool as sp
from fleetrl.broker.staleness import min_fresh_version, staleness
from fleetrl.common import messages as m
from fleetrl.common.config.schema import BrokerConfig

if TYPE_CHECKING:
    from fleetrl.broker.state import Rate


@dataclass
class BatchLeaseState:
    lease_id: str
    client_id: str
    group_ids: list[str]
    expires_at: float


class BatchLeasing:
    """Request handlers of learners (``LeaseBatch``, ``AckBatch``, ``Commit``, ``Rewind``) and lease expiry.

    Uses from BrokerState: ``_touch`` (client records), ``_enqueue`` / ``_dequeue`` (the queue),
    ``_drop`` (forget groups, maybe re-issue their prompts) and ``_log`` (append to the spool).
    """

    bcfg: BrokerConfig
    version: int
    groups: dict[str, m.SampleGroup]  # every live group, queued or not
    queued: set[str]
    batch_leases: dict[str, BatchLeaseState]
    uncommitted: dict[str, list[tuple[int, str]]]  # learner -> [(ack step, gid)]
    counters: Counter[str]
    staleness_hist: Counter[int]
    rate_out: Rate

    @property
    def in_flight(self) -> int:
        """Groups leased to learners and not acknowledged yet."""
        return sum(len(lease.group_ids) for lease in self.batch_leases.values())

    def _on_LeaseBatch(self, req: m.LeaseBatch, now: float, final: bool = False) -> m.Message | None:
        """Fill a batch lease, dropping stale groups on the way; None = wait for more groups."""
        self._touch(req.client_id, now, "learner")
        if req.n <= 0:
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"LeaseBatch.n must be positive, got {req.n}")
        ready = len(self.queued)
        if ready < min(req.min_groups, req.n) and not final and req.wait_s > 0:
            return None
        oldest = min_fresh_version(self.version, self.bcfg.max_staleness)
        ids, stale = [], []
        while len(ids) < req.n:
            gid = self._dequeue()
            if gid is None:
                break
            version = self.groups[gid].policy_version
            if version < oldest:  # checked as it is handed out: O(batch), not O(queue)
                stale.append(gid)
                continue
            ids.append(gid)
            self.staleness_hist[staleness(self.version, version)] += 1
        if stale:
            self._drop(stale, "dropped_stale", self.bcfg.requeue_stale)
        if not ids:
            if not final and req.wait_s > 0:
                return None
            return m.Throttle(req_id=req.req_id, retry_after_s=0.2, reason="no fresh groups queued yet")
        lease = BatchLeaseState(uuid.uuid4().hex[:16], req.client_id, ids, now + self.bcfg.batch_lease_s)
        self.batch_leases[lease.lease_id] = lease
        self.counters["groups_out"] += len(ids)
        self.rate_out.add(now, len(ids))
        return m.BatchLease(req_id=req.req_id, lease_id=lease.lease_id, groups=[self.groups[g] for g in ids],
                            expires_in_s=self.bcfg.batch_lease_s, dropped_stale=len(stale))

    def lease_batch_final(self, req: m.LeaseBatch, now: float) -> m.Message:
        """Answer a waiting LeaseBatch at its deadline with whatever is there."""
        return self._on_LeaseBatch(req, now, final=True)  # type: ignore[return-value]

    def _on_AckBatch(self, req: m.AckBatch, now: float) -> m.Message:
        self._touch(req.client_id, now, "learner")
        lease = self.batch_leases.get(req.lease_id)
        if lease is not None and not (req.keep_rest and req.group_ids):
            del self.batch_leases[req.lease_id]
        if lease is None:
            # Expired and put back: take back the groups that were not re-leased yet.
            wanted = req.group_ids
            salvaged = [gid for gid in wanted if gid in self.queued]
            for gid in salvaged:
                self.queued.discard(gid)
            self._consume(req.client_id, req.step, salvaged)
            self.counters["late_acks"] += 1
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(salvaged))
        acked = set(req.group_ids)
        trained = [g for g in lease.group_ids if g in acked] if acked else lease.group_ids
        untrained = [g for g in lease.group_ids if g not in acked] if acked else []
        if req.keep_rest and acked:  # done with some groups now (e.g. filtered ones); the lease keeps the rest
            lease.group_ids = untrained
            if not untrained:
                del self.batch_leases[req.lease_id]
        else:
            for gid in reversed(untrained):
                self._enqueue(gid, front=True)
        self._consume(req.client_id, req.step, trained)
        return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(trained))

    def _consume(self, client_id: str, step: int, gids: list[str]) -> None:
        if not gids:
            return
        self.counters["groups_trained"] += len(gids)
        if self.bcfg.commit_on_checkpoint:
            self.uncommitted.setdefault(client_id, []).extend((step, gid) for gid in gids)
            self._log(sp.GroupsAcked(client_id, step, gids))
        else:
            for gid in gids:
                self.groups.pop(gid, None)
            self._log(sp.GroupsDone(gids))

    def _on_Commit(self, req: m.Commit, now: float) -> m.Message:
        self._touch(req.client_id, now, "learner")
        entries = self.uncommitted.get(req.client_id, [])
        done = [gid for step, gid in entries if step <= req.step]
        for gid in done:
            self.groups.pop(gid, None)
        self.uncommitted[req.client_id] = [(s, g) for s, g in entries if s > req.step]
        self._log(sp.Committed(req.client_id, req.step))
        self.counters["groups_committed"] += len(done)
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=len(done))

    def _on_Rewind(self, req: m.Rewind, now: float) -> m.Message:
        """A learner resumed from its checkpoint at ``step``: everything it holds beyond that comes back."""
        self._touch(req.client_id, now, "learner")
        entries = self.uncommitted.get(req.client_id, [])
        back = [gid for step, gid in entries if step > req.step and gid in self.groups]
        self.uncommitted[req.client_id] = [(s, g) for s, g in entries if s <= req.step]
        leased = [lid for lid, lease in self.batch_leases.items() if lease.client_id == req.client_id]
        for lid in leased:
            back.extend(self.batch_leases.pop(lid).group_ids)
        for gid in reversed(back):
            self._enqueue(gid, front=True)
        self._log(sp.Rewound(req.client_id, req.step))
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=len(back))

    def _redeliver_expired(self, now: float) -> int:
        """Put the groups of expired batch leases back at the front of the queue; returns how many."""
        redelivered = 0
        for lid in [lid for lid, lease in self.batch_leases.items() if lease.expires_at <= now]:
            lease = self.batch_leases.pop(lid)
            for gid in reversed(lease.group_ids):
                if gid in self.groups:
                    self._enqueue(gid, front=True)
                    redelivered += 1
        self.counters["groups_redelivered"] += redelivered
        return redelivered
