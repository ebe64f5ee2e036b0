"""The learner half of the broker's protocol: batch leases, acknowledgements, commits and rewinds.

A learner leases a batch of queued groups (stale ones are set aside as they are handed out, so the
check costs O(batch), not O(queue)), then acknowledges the groups it trained. Without
``broker.commit_on_checkpoint`` an acknowledged group is forgotten at once; with it, the group is kept
until a ``Commit`` at a checkpoint covers its step, and a ``Rewind`` after a resume puts everything
trained past that checkpoint back at the front of the queue, in order. A batch lease that is not
acknowledged within ``broker.batch_lease_s`` is redelivered the same way.

:class:`BatchLeases` is one object that :class:`~fleetrl.broker.server.state.BrokerState` holds: it owns the
leases and the uncommitted acks, works on the shared :class:`~fleetrl.broker.server.queue.GroupQueue`, and
writes its records through ``journal`` *before* it changes anything (durable before acknowledged).
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fleetrl.broker.server import spool as sp
from fleetrl.broker.server.queue import GroupQueue
from fleetrl.common import messages as m
from fleetrl.common.config.schema import BrokerConfig

Journal = Callable[[list[sp.Record]], None]  # writes records or raises SpoolUnavailable
HISTORY = 4096  # leases remembered after they expire (or the broker restarted): a late ack takes back only their groups


@dataclass
class BatchLeaseState:
    lease_id: str
    client_id: str
    group_ids: list[str]
    expires_at: float


class Unauthorized(Exception):
    """A learner acted on a lease that is not its own."""


class BatchLeases:
    def __init__(self, bcfg: BrokerConfig, queue: GroupQueue, journal: Journal, counters: Counter[str]):
        self.bcfg, self.q, self.journal, self.counters = bcfg, queue, journal, counters
        self.leases: dict[str, BatchLeaseState] = {}
        self.uncommitted: dict[str, list[tuple[int, str]]] = {}  # learner -> [(ack step, gid)]
        self.history: OrderedDict[str, tuple[str, list[str]]] = OrderedDict()  # expired lease -> (client, gids)

    @property
    def in_flight(self) -> int:
        """Groups leased to learners and not acknowledged yet."""
        return sum(len(lease.group_ids) for lease in self.leases.values())

    def held(self) -> int:
        return self.in_flight + sum(len(e) for e in self.uncommitted.values())

    # ---------------------------------------------------------------- leasing
    def take(self, n: int, oldest: int, max_bytes: int | None = None) -> tuple[list[str], list[str]]:
        """Dequeue up to ``n`` fresh group ids (version >= ``oldest``) weighing at most ``max_bytes`` together (at
        least one), and the stale ones met on the way."""
        ids: list[str] = []
        stale: list[str] = []
        total = 0
        while len(ids) < n:
            gid = self.q.dequeue()
            if gid is None:
                break
            if self.q.groups[gid].policy_version < oldest:
                stale.append(gid)
                continue
            size = self.q.sizes.get(gid, 0)
            if ids and max_bytes is not None and total + size > max_bytes:
                self.q.enqueue(gid, front=True)  # the next lease starts with it
                break
            ids.append(gid)
            total += size
        return ids, stale

    def open(self, client_id: str, ids: list[str], now: float) -> BatchLeaseState:
        lease = BatchLeaseState(uuid.uuid4().hex[:16], client_id, ids, now + self.bcfg.batch_lease_s)
        try:  # best effort: only a late ack after a restart needs it (docs/broker.md#batch-leases)
            self.journal([sp.BatchLeased(lease.lease_id, client_id, ids)])
        except sp.SpoolUnavailable:
            self.counters["spool_unavailable"] += 1
        self.leases[lease.lease_id] = lease
        self.counters["groups_out"] += len(ids)
        return lease

    # ------------------------------------------------------------------- acks
    def ack(self, req: m.AckBatch, now: float) -> m.Ack:
        """Consume the acked groups (journal first); raises Unauthorized for another learner's lease."""
        lease = self.leases.get(req.lease_id)
        if lease is None:
            return self._late_ack(req)
        if lease.client_id != req.client_id:
            raise Unauthorized(f"lease {req.lease_id} is held by {lease.client_id}, not {req.client_id}")
        acked = set(req.group_ids)
        if req.give_back:  # none trained (a learner's prefetched batch it cannot use): all go back
            trained, untrained = [], list(lease.group_ids)
        else:
            trained = [g for g in lease.group_ids if g in acked] if acked else list(lease.group_ids)
            untrained = [g for g in lease.group_ids if g not in acked] if acked else []
        self._consume(req.client_id, req.step, trained)  # may raise SpoolUnavailable: nothing changed yet
        if req.keep_rest and acked and not req.give_back:  # done with some (e.g. filtered ones); it keeps the rest
            lease.group_ids = untrained
            if not untrained:
                del self.leases[req.lease_id]
        else:
            del self.leases[req.lease_id]
            self.q.requeue_front(untrained)
        return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(trained))

    def _late_ack(self, req: m.AckBatch) -> m.Ack:
        """A lease the broker no longer holds (expired, or lost in a restart): take back the groups it held that
        were not re-leased since. An unknown or someone else's lease id takes back nothing."""
        client, held = self.history.get(req.lease_id, ("", []))
        if req.give_back:  # the groups went back when the lease expired: nothing to take
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=0)
        if client != req.client_id:
            self.counters["late_acks_refused"] += 1
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=0)
        wanted = set(req.group_ids) if req.group_ids else set(held)
        salvaged = [g for g in held if g in wanted and g in self.q.queued]
        self._consume(req.client_id, req.step, salvaged)
        self.q.take_queued(salvaged)
        self.counters["late_acks"] += 1
        return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(salvaged))

    def _consume(self, client_id: str, step: int, gids: list[str]) -> None:
        if not gids:
            return
        if self.bcfg.commit_on_checkpoint:
            self.journal([sp.GroupsAcked(client_id, step, gids)])
            self.uncommitted.setdefault(client_id, []).extend((step, gid) for gid in gids)
        else:
            self.journal([sp.GroupsDone(gids)])
            for gid in gids:
                self.q.release(gid)
        self.counters["groups_trained"] += len(gids)

    def commit(self, req: m.Commit) -> m.Ack:
        entries = self.uncommitted.get(req.client_id, [])
        self.journal([sp.Committed(req.client_id, req.step)])
        done = [gid for step, gid in entries if step <= req.step]
        for gid in done:
            self.q.release(gid)
        self.uncommitted[req.client_id] = [(s, g) for s, g in entries if s > req.step]
        self.counters["groups_committed"] += len(done)
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=len(done))

    def rewind(self, req: m.Rewind) -> m.Ack:
        """A learner resumed from its checkpoint at ``step``: everything it holds beyond that comes back."""
        self.journal([sp.Rewound(req.client_id, req.step)])
        entries = self.uncommitted.get(req.client_id, [])
        back = [gid for step, gid in entries if step > req.step and gid in self.q.groups]
        self.uncommitted[req.client_id] = [(s, g) for s, g in entries if s <= req.step]
        for lid in [lid for lid, lease in self.leases.items() if lease.client_id == req.client_id]:
            back.extend(self._retire(lid).group_ids)
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=self.q.requeue_front(back))

    def release(self, client_id: str) -> int:
        """A learner left: the groups of its open leases go back to the front of the queue; returns how many."""
        back = [
            g
            for lid in [lid for lid, lease in self.leases.items() if lease.client_id == client_id]
            for g in self._retire(lid).group_ids
        ]
        return self.q.requeue_front(back)

    # ---------------------------------------------------------------- expiry
    def _retire(self, lease_id: str) -> BatchLeaseState:
        lease = self.leases.pop(lease_id)
        self.history[lease_id] = (lease.client_id, list(lease.group_ids))
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)
        return lease

    def redeliver_expired(self, now: float) -> int:
        """Put the groups of expired batch leases back at the front of the queue; returns how many."""
        redelivered = 0
        for lid in [lid for lid, lease in self.leases.items() if lease.expires_at <= now]:
            redelivered += self.q.requeue_front(self._retire(lid).group_ids)
        self.counters["groups_redelivered"] += redelivered
        return redelivered

    def restore(self, rec: sp.Recovered) -> None:
        """After a restart: the recovered uncommitted acks, and the leases of the old process as history."""
        self.uncommitted = {c: list(e) for c, e in rec.uncommitted.items() if e}
        self.history = OrderedDict((lid, (c, list(g))) for lid, (c, g) in rec.batch_leases.items())
