"""The broker's state machine: one request in, one reply out. No sockets, no clocks of its own.

``BrokerState.handle(request, now)`` is the whole protocol. The ZeroMQ server and the in-process twin
both drive it; tests drive it directly. Every group lives in ``self.groups`` from the moment it is
acknowledged until it is consumed for good (trained and, with ``commit_on_checkpoint``, committed),
dropped as stale, or discarded — and every such transition is appended to the spool first.

This module holds the rollout side (prompt leases, group pushes), versions, control and status; the
learner side (batch leases, acks, commits, rewinds) is the ``BatchLeasing`` mixin in ``leases.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from fleetrl.broker import spool as sp
from fleetrl.broker.leases import BatchLeaseState, BatchLeasing
from fleetrl.broker.prompts import PromptSource
from fleetrl.broker.staleness import admission_capacity, min_fresh_version, rollout_is_fresh
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig

log = logging.getLogger(__name__)

DEDUPE_WINDOW = 1 << 20  # acknowledged group ids remembered for de-duplication


@dataclass
class ClientState:
    client_id: str
    role: str
    rank: int = 0
    policy_version: int = 0
    last_seen: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    groups_pushed: int = 0


class Rate:
    """Events per second over a sliding window of one-second buckets."""

    def __init__(self, window_s: int = 10):
        self.window_s = window_s
        self.buckets: deque[list[float]] = deque()

    def add(self, now: float, n: int = 1) -> None:
        sec = int(now)
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([sec, n])
        while self.buckets and self.buckets[0][0] <= sec - self.window_s:
            self.buckets.popleft()

    def per_s(self, now: float) -> float:
        horizon = int(now) - self.window_s
        return sum(n for s, n in self.buckets if s > horizon) / self.window_s


class BrokerState(BatchLeasing):
    def __init__(self, cfg: JobConfig, prompts: PromptSource, vocab_size: int = 0, spool: sp.Spool | None = None,
                 broker_id: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.bcfg = cfg, cfg.broker
        self.prompts = prompts
        self.vocab_size = vocab_size
        self.spool = spool
        self.broker_id = broker_id or uuid.uuid4().hex[:12]
        self.started = clock()
        self.capacity = self.bcfg.queue_capacity or admission_capacity(
            cfg.learner.groups_per_step, cfg.sync.interval, self.bcfg.max_staleness
        )
        self.groups: dict[str, m.SampleGroup] = {}  # every live group, queued or not
        self.queue: deque[str] = deque()  # ids ready for learners, oldest first
        self.queued: set[str] = set()
        self.batch_leases: dict[str, BatchLeaseState] = {}
        self.uncommitted: dict[str, list[tuple[int, str]]] = {}  # learner -> [(ack step, gid)]
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.clients: dict[str, ClientState] = {}
        self.version = 0
        self.version_step = 0
        self.weights = m.WeightsInfo()
        self.paused = False
        self.stopping = False
        self.learner_done = ""  # why the learner finished ("" = training goes on); a learner registering clears it
        self.pub_port = 0  # set by the server once the PUB socket is bound
        self.discarded_versions: list[tuple[int, float]] = []  # version ranges a learner rolled back
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.rate_in, self.rate_out = Rate(), Rate()
        self.announcements: list[tuple[bytes, m.Message]] = []  # to publish after this request
        if spool is not None:
            self._recover(spool.recover())

    # ------------------------------------------------------------------ spool
    def _log(self, rec: sp.Record) -> None:
        if self.spool is not None:
            self.spool.append(rec)

    def _recover(self, rec: sp.Recovered) -> None:
        acked = {gid for entries in rec.uncommitted.values() for _, gid in entries}
        self.groups = dict(rec.groups)
        self.uncommitted = {c: list(e) for c, e in rec.uncommitted.items() if e}
        for gid in rec.groups:
            if gid not in acked:
                self._enqueue(gid)
        self.seen = rec.seen
        self.prompts.seek(rec.epoch, rec.pos)
        for p in rec.open_prompts.values():
            self.prompts.requeue(p)
        if rec.version is not None:
            self.version, self.version_step, self.weights = rec.version.version, rec.version.step, rec.version.weights
        self.discarded_versions = [(lo, float("inf") if hi < 0 else hi) for lo, hi in rec.discarded]
        if rec.records:
            log.info("recovered from the spool: %d records, %d queued groups, %d uncommitted, %d open prompts, version %d",
                     rec.records, len(self.queue), len(acked), len(rec.open_prompts), self.version)

    def snapshot(self) -> list[sp.Record]:
        """The live state as spool records (compaction)."""
        recs: list[sp.Record] = [sp.VersionSet(self.version, self.version_step, self.weights)]
        open_prompts = [lease_p for lease in self.prompts.leases.values() for lease_p in lease.prompts.values()]
        recs.append(sp.PromptsLeased(open_prompts, self.prompts.epoch, self.prompts.pos))
        recs.append(sp.PromptsRequeued(list(self.prompts.reissue)))
        recs.extend(sp.GroupAccepted(g) for g in self.groups.values())
        for client, entries in self.uncommitted.items():
            for step, gid in entries:
                recs.append(sp.GroupsAcked(client, step, [gid]))
        recs.append(sp.SeenIds(list(self.seen)[-sp.SEEN_WINDOW:]))
        recs.extend(sp.VersionsDiscarded(lo, -1 if hi == float("inf") else int(hi)) for lo, hi in self.discarded_versions)
        return recs

    # --------------------------------------------------------------- helpers
    def _enqueue(self, gid: str, front: bool = False) -> None:
        if gid in self.queued:
            return
        (self.queue.appendleft if front else self.queue.append)(gid)
        self.queued.add(gid)

    def _dequeue(self) -> str | None:
        while self.queue:
            gid = self.queue.popleft()
            if gid in self.queued:
                self.queued.discard(gid)
                return gid
        return None

    def _remember(self, gid: str) -> None:
        self.seen[gid] = None
        if len(self.seen) > DEDUPE_WINDOW:
            self.seen.popitem(last=False)

    def _drop(self, gids: list[str], reason: str, requeue_prompts: bool) -> None:
        if not gids:
            return
        prompts = []
        for gid in gids:
            g = self.groups.pop(gid, None)
            self.queued.discard(gid)
            if g is not None and requeue_prompts:
                p = self.prompts.lookup(g.prompt_id)
                if p is not None:
                    prompts.append(p)
        self.counters[reason] += len(gids)
        self._log(sp.GroupsDone(gids))
        if prompts:
            for p in prompts:
                self.prompts.requeue(p)
            self._log(sp.PromptsRequeued(prompts))

    def _touch(self, client_id: str, now: float, role: str = "", version: int | None = None) -> ClientState:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = ClientState(client_id, role or "unknown")
        c.last_seen = now
        if version is not None:
            c.policy_version = version
        return c

    def load(self) -> int:
        """Groups queued, being generated, or being trained: what admission control bounds."""
        return len(self.queued) + self.prompts.leased + self.in_flight  # `queue` keeps removed ids until popped

    # ------------------------------------------------------------- dispatch
    def handle(self, req: m.Message, now: float) -> m.Message | None:
        """Apply one request; returns its reply, or None for a LeaseBatch that should wait."""
        handler = getattr(self, "_on_" + type(req).__name__, None)
        if handler is None:  # pragma: no cover - every Request type has a handler
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"no handler for {type(req).__name__}")
        return handler(req, now)

    def _on_Register(self, req: m.Register, now: float) -> m.Message:
        if req.protocol != m.PROTOCOL_VERSION:
            self.rejected["protocol_mismatch"] += 1
            return m.Error(req_id=req.req_id, code="protocol_mismatch",
                           reason=f"client speaks protocol {req.protocol}, broker {m.PROTOCOL_VERSION}; install matching fleetrl versions")
        c = self._touch(req.client_id, now, req.role)
        c.role, c.rank, c.info = req.role, req.rank, dict(req.info)
        if req.role == "learner" and self.learner_done:
            log.info("learner %s registered: training goes on after `done` (%s)", req.client_id, self.learner_done)
            self.learner_done = ""
        return m.Registered(req_id=req.req_id, broker_id=self.broker_id, policy_version=self.version,
                            vocab_size=self.vocab_size, heartbeat_s=self.bcfg.heartbeat_s, weights=self.weights,
                            paused=self.paused, pub_port=self.pub_port,
                            max_message_bytes=self.bcfg.max_message_bytes)

    def _on_Heartbeat(self, req: m.Heartbeat, now: float) -> m.Message:
        c = self._touch(req.client_id, now, version=req.policy_version)
        c.stats = dict(req.stats)
        return m.Ack(req_id=req.req_id, ref=req.client_id)

    def _on_LeasePrompts(self, req: m.LeasePrompts, now: float) -> m.Message:
        self._touch(req.client_id, now, "rollout", req.policy_version)
        if req.n <= 0:
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"LeasePrompts.n must be positive, got {req.n}")
        if self.paused or self.stopping:
            self.counters["throttled"] += 1
            return m.Throttle(req_id=req.req_id, retry_after_s=1.0, reason="stopping" if self.stopping else "paused")
        if self.learner_done:  # nobody trains on new groups: say so (a server that missed `done` learns it here)
            self.counters["throttled"] += 1
            return m.Throttle(req_id=req.req_id, retry_after_s=2.0, reason=f"done: {self.learner_done}")
        if not rollout_is_fresh(self.version, req.policy_version, self.bcfg.max_staleness):
            self.counters["throttled"] += 1
            return m.Throttle(req_id=req.req_id, retry_after_s=0.2,
                              reason=f"policy version {req.policy_version} is too stale (current {self.version}); load new weights")
        room = self.capacity - self.load()
        if room <= 0:
            self.counters["throttled"] += 1
            return m.Throttle(req_id=req.req_id, retry_after_s=0.1, reason=f"at capacity ({self.capacity} groups)")
        prompts = self.prompts.take(min(req.n, room))
        if not prompts:
            if self.prompts.exhausted and not self.prompts.leases:
                return m.Error(req_id=req.req_id, code="data_exhausted",
                               reason=f"all {self.prompts.epochs} epoch(s) of the prompt set were served; raise data.epochs")
            return m.Throttle(req_id=req.req_id, retry_after_s=1.0, reason="waiting for leased prompts to come back")
        lease = self.prompts.open_lease(req.client_id, prompts, now, self.bcfg.prompt_lease_s)
        self._log(sp.PromptsLeased(prompts, self.prompts.epoch, self.prompts.pos))
        self.counters["prompts_leased"] += len(prompts)
        return m.PromptLease(req_id=req.req_id, lease_id=lease.lease_id, prompts=prompts,
                             expires_in_s=self.bcfg.prompt_lease_s, policy_version=self.version)

    def _on_ReturnPrompts(self, req: m.ReturnPrompts, now: float) -> m.Message:
        self._touch(req.client_id, now)
        lease = self.prompts.leases.get(req.lease_id)
        if lease is None:
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=0)
        ids = list(dict.fromkeys(req.prompt_ids)) or list(lease.prompts)  # a repeated id is returned once
        returned = [lease.prompts[i] for i in ids if i in lease.prompts]
        if req.unscored:  # no reward could score them: re-issuing would only score nothing again
            for pid in ids:
                self.prompts.fulfil(pid)
            self.counters["prompts_unscored"] += len(returned)
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(returned))
        n = self.prompts.give_back(req.lease_id, ids)
        self._log(sp.PromptsRequeued(returned))
        return m.Ack(req_id=req.req_id, ref=req.lease_id, count=n)

    def _ingest(self, g: m.SampleGroup, client: ClientState, now: float) -> tuple[str, str]:
        """Accept one group: (status, reason) with status accepted | duplicate | stale | rejected."""
        if g.group_id in self.seen or g.group_id in self.groups:
            self.counters["duplicates"] += 1
            return "duplicate", ""
        problem = m.check_group(g, self.vocab_size)
        if problem:
            self.rejected["invalid_group"] += 1
            return "rejected", problem
        self.prompts.fulfil(g.prompt_id)
        self._remember(g.group_id)
        self.groups[g.group_id] = g
        self._log(sp.GroupAccepted(g))
        self.counters["groups_in"] += 1
        client.groups_pushed += 1
        self.rate_in.add(now)
        if any(lo <= g.policy_version <= hi for lo, hi in self.discarded_versions):
            self._drop([g.group_id], "discarded", requeue_prompts=True)
            return "stale", f"policy version {g.policy_version} was rolled back by the learner"
        if g.policy_version < min_fresh_version(self.version, self.bcfg.max_staleness):
            self._drop([g.group_id], "dropped_stale", self.bcfg.requeue_stale)
            return "stale", f"policy version {g.policy_version} is older than {min_fresh_version(self.version, self.bcfg.max_staleness)}"
        self._enqueue(g.group_id)
        return "accepted", ""

    def _on_PushGroup(self, req: m.PushGroup, now: float) -> m.Message:
        status, reason = self._ingest(req.group, self._touch(req.client_id, now, "rollout"), now)
        if status == "rejected":
            return m.Error(req_id=req.req_id, code="invalid_group", reason=reason)
        return m.Ack(req_id=req.req_id, ref=req.group.group_id, count=int(status == "accepted"),
                     duplicate=status == "duplicate")

    def _on_PushGroups(self, req: m.PushGroups, now: float) -> m.Message:
        client = self._touch(req.client_id, now, "rollout")
        acks = []
        for g in req.groups:
            status, reason = self._ingest(g, client, now)
            acks.append(m.GroupAck(group_id=g.group_id, status=status, reason=reason))
        return m.GroupAcks(req_id=req.req_id, acks=acks)

    # LeaseBatch, AckBatch, Commit and Rewind (the learner side): BatchLeasing in leases.py

    def _on_PublishVersion(self, req: m.PublishVersion, now: float) -> m.Message:
        self._touch(req.client_id, now, "learner", req.version)
        if req.version < self.version:
            self.counters["version_rewinds"] += 1
            log.warning("policy version goes back from %d to %d (learner resumed or rolled back)", self.version, req.version)
        self.version, self.version_step, self.weights = req.version, req.step, req.weights
        self._log(sp.VersionSet(req.version, req.step, req.weights))
        self.announcements.append((m.TOPIC_VERSION, m.VersionAnnouncement(version=req.version, step=req.step, weights=req.weights)))
        return m.Ack(req_id=req.req_id, ref=str(req.version))

    def _on_Control(self, req: m.Control, now: float) -> m.Message:
        self._touch(req.client_id, now)
        count = 0
        if req.action == "pause":
            self.paused = True
        elif req.action == "resume":
            self.paused = False
        elif req.action == "stop":
            self.stopping = True
        elif req.action == "discard":
            hi = req.max_version if req.max_version >= 0 else float("inf")
            doomed = [gid for gid in self.queue if gid in self.queued and req.min_version <= self.groups[gid].policy_version <= hi]
            self._drop(doomed, "discarded", requeue_prompts=True)
            self.discarded_versions.append((req.min_version, hi))  # late arrivals from these versions too
            self._log(sp.VersionsDiscarded(req.min_version, req.max_version))  # ... even after a restart
            count = len(doomed)
        self.announcements.append((m.TOPIC_CONTROL, m.ControlAnnouncement(
            action=req.action, reason=req.reason, min_version=req.min_version, max_version=req.max_version)))
        log.info("control %s from %s (%s)%s", req.action, req.client_id, req.reason, f": {count} groups discarded" if count else "")
        return m.Ack(req_id=req.req_id, ref=req.action, count=count)

    def _on_GetVersion(self, req: m.GetVersion, now: float) -> m.Message:
        if req.client_id:
            self._touch(req.client_id, now)
        return m.CurrentVersion(req_id=req.req_id, version=self.version, step=self.version_step, weights=self.weights,
                                paused=self.paused)

    def _on_GetStatus(self, req: m.GetStatus, now: float) -> m.Message:
        return self.status(req.req_id, now)

    def _on_Leave(self, req: m.Leave, now: float) -> m.Message:
        """A graceful exit: the client leaves the fleet at once (no wait for broker.client_timeout_s)."""
        client = self.clients.pop(req.client_id, None)
        reissued = self._reissue_leases(now, {req.client_id})  # prompts it still held (normally returned already)
        back = [gid for lid, lease in list(self.batch_leases.items()) if lease.client_id == req.client_id
                for gid in self.batch_leases.pop(lid).group_ids if gid in self.groups]
        for gid in reversed(back):
            self._enqueue(gid, front=True)
        role = client.role if client is not None else "unknown"
        if req.done and role == "learner":
            self.learner_done = req.reason or f"{req.client_id} finished"
            self.announcements.append((m.TOPIC_CONTROL, m.ControlAnnouncement(action="done", reason=self.learner_done)))
        log.info("%s %s left (%s)%s%s", role, req.client_id, req.reason or "no reason given",
                 f"; {reissued} prompt(s) re-issued" if reissued else "", f"; {len(back)} group(s) requeued" if back else "")
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=reissued + len(back))

    def announce_shutdown(self, reason: str = "the broker is shutting down") -> None:
        """Tell every subscriber the job is over before the broker exits (rollouts started by hand then stop
        unless rollout.stay_after_done)."""
        self.announcements.append((m.TOPIC_CONTROL, m.ControlAnnouncement(action="done", reason=reason)))

    # ------------------------------------------------------------- timers
    def dead_clients(self, now: float) -> set[str]:
        return {c.client_id for c in self.clients.values() if now - c.last_seen > self.bcfg.client_timeout_s}

    def expire(self, now: float) -> dict[str, int]:
        """Re-issue expired prompt leases (and those of dead clients); redeliver expired batch leases."""
        reissued = self._reissue_leases(now, self.dead_clients(now))
        return {"prompts_reissued": reissued, "groups_redelivered": self._redeliver_expired(now)}

    def _reissue_leases(self, now: float, clients: set[str]) -> int:
        """Re-issue expired prompt leases and those held by ``clients`` (spooled); returns how many prompts."""
        open_before = {pid: lease.prompts[pid] for lease in self.prompts.leases.values() for pid in lease.prompts}
        reissued = self.prompts.expire(now, clients)
        if reissued:
            requeued = [open_before[pid] for pid in open_before if pid not in self.prompts.lease_of]
            self._log(sp.PromptsRequeued(requeued))
            self.counters["prompts_reissued"] += reissued
        return reissued

    # ------------------------------------------------------------- status
    def status(self, req_id: int, now: float) -> m.Status:
        return m.Status(
            req_id=req_id, broker_id=self.broker_id, uptime_s=now - self.started, policy_version=self.version,
            queue_depth=len(self.queued), groups_in_flight=self.in_flight, prompts_leased=self.prompts.leased,
            groups_in=self.counters["groups_in"], groups_out=self.counters["groups_out"],
            groups_in_per_s=self.rate_in.per_s(now), groups_out_per_s=self.rate_out.per_s(now),
            dropped_stale=self.counters["dropped_stale"], duplicates=self.counters["duplicates"],
            rejected=dict(self.rejected), staleness_hist={str(k): v for k, v in sorted(self.staleness_hist.items())},
            clients=[
                m.ClientInfo(client_id=c.client_id, role=c.role, rank=c.rank, policy_version=c.policy_version,
                             last_seen_s=round(now - c.last_seen, 3), alive=now - c.last_seen <= self.bcfg.client_timeout_s,
                             stats={**c.stats, "groups_pushed": float(c.groups_pushed)} if c.groups_pushed else c.stats)
                for c in self.clients.values()
            ],
            paused=self.paused, data_epoch=self.prompts.epoch, data_cursor=self.prompts.pos,
            throttled=self.counters["throttled"], uncommitted=sum(len(e) for e in self.uncommitted.values()),
        )
