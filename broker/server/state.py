"""The broker's state machine: one request in, one reply out. No sockets, no clocks of its own.

``BrokerState.handle(request, now, principal)`` is the whole protocol. The ZeroMQ server and the
in-process twin both drive it; tests drive it directly. Each request is first checked against the
permission table (``permissions.authorize``: the role behind the request's key, and that its
``client_id`` is the key's), then handled. Every group lives in ``queue.groups`` from the moment it is
acknowledged until it is consumed for good, dropped as stale, or discarded — and every such
transition is written to the spool *before* the state changes, so a write that fails (a full disk)
leaves no trace and is answered ``unavailable``.

Composition: ``self.q`` (GroupQueue: groups, queue, de-duplication), ``self.journal`` (Journal: the
spool, written before every change), ``self.batches`` (BatchLeases: the learner side), ``self.prompts``
(PromptSource: the rollout side's leases), ``self.clients`` (ClientTable), ``self.admission``
(Admission: capacity and load); ingest is in ``ingest.py``, controls and versions in ``control.py``.
Each piece is handed only the others it needs (ingest: the queue, prompts, journal, admission and
controls), never the state itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal, cast

from fleetrl.broker.security.auth import Principal
from fleetrl.broker.security.fairness import KeyLimiter, PromptShares
from fleetrl.broker.security.permissions import REGISTRATION_FREE, authorize
from fleetrl.broker.server import spool as sp
from fleetrl.broker.server.admission import Admission
from fleetrl.broker.server.client_table import ClientState, ClientTable, receivers_error
from fleetrl.broker.server.control import Controls
from fleetrl.broker.server.ingest import Ingest
from fleetrl.broker.server.journal import Journal
from fleetrl.broker.server.leases import BatchLeases, Unauthorized
from fleetrl.broker.server.plausible import Plausibility
from fleetrl.broker.server.prompts import PromptSource, fit_bytes
from fleetrl.broker.server.queue import GroupQueue
from fleetrl.broker.server.rates import Rate
from fleetrl.broker.server.staleness import min_fresh_version, rollout_is_fresh, staleness
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig

log = logging.getLogger(__name__)

Audit = Callable[[dict[str, Any]], None]
AUDITED = (m.Control, m.PublishVersion, m.Commit, m.Rewind)
RATE_LIMITED = (m.Register, m.GetStatus, m.GetVersion)  # cheap to send, costly to serve: broker.key_requests_per_s
AckStatus = Literal["accepted", "duplicate", "stale", "rejected", "throttled"]  # GroupAck.status (ingest's verdicts)


class BrokerState:
    def __init__(
        self,
        cfg: JobConfig,
        prompts: PromptSource,
        vocab_size: int = 0,
        spool: sp.Spool | None = None,
        broker_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        audit: Audit | None = None,
        wall: Callable[[], float] = time.time,
    ):
        self.cfg, self.bcfg = cfg, cfg.broker
        self.prompts, self.vocab_size, self.spool, self.audit, self.wall = prompts, vocab_size, spool, audit, wall
        self.broker_id = broker_id or uuid.uuid4().hex[:12]
        self.started = clock()
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.rate_out = Rate()
        self.status_stats: Callable[[float], dict[str, float]] = lambda now: {}  # the server's wire and process stats
        self.pub_port = 0  # set by the server once the PUB socket is bound
        self.announcements: list[tuple[bytes, m.Message]] = []  # to publish after this request
        self.q = GroupQueue(self.bcfg.max_dedupe_bytes)
        self.journal = Journal(spool, self.counters, self._audit_event)
        self.batches = BatchLeases(self.bcfg, self.q, self.journal.write, self.counters)
        self.plausibility = Plausibility.of(cfg)
        self.limiter, self.shares = KeyLimiter(self.bcfg.key_requests_per_s), PromptShares()
        self.key = ""  # the CURVE identity behind the request being handled ("" without CURVE)
        self.clients = ClientTable(self.bcfg)
        self.admission = Admission(cfg, self.q, prompts, self.batches)
        self.controls = Controls(
            cfg,
            self.q,
            self.journal,
            self.drop,
            self.announcements,
            self.admission.measured,
            self.counters,
            self.rejected,
            wall,
        )
        self.ingest = Ingest(
            cfg,
            vocab_size,
            self.q,
            prompts,
            self.journal,
            self.admission,
            self.controls,
            self.counters,
            self.rejected,
            self.plausibility,
            self.clients,
        )
        self.recovery: dict[str, int] = {}
        self.learner_done = ""  # why the learner finished ("" = training goes on); a learner registering clears it
        self.leases_ahead = 0  # 1 once a learner leases ahead of its publish (trains_at); a learner registering: 0
        if spool is not None:
            self._recover(spool.recover())

    # ------------------------------------------------------------- views (tests, status)
    groups = property(lambda self: self.q.groups)
    queue = property(lambda self: self.q.queue)
    queued = property(lambda self: self.q.queued)
    uncommitted = property(lambda self: self.batches.uncommitted)
    in_flight = property(lambda self: self.batches.in_flight)
    version = property(lambda self: self.controls.version)

    @property
    def trains_at(self) -> int:
        """The version groups leased from now on are trained at: the newest published one, or the one after it
        once a learner leases ahead of its publish (learner.prefetch: ``LeaseBatch.for_version``; it then does
        so every step, so this holds also between a publish and the next lease ahead, when rollouts load the new
        weights and ask for work). Admission shortens its window by the difference (``Admission.room``)."""
        return self.version + self.leases_ahead

    paused = property(lambda self: self.controls.paused)
    discarded_versions = property(lambda self: self.controls.discarded.ranges())

    measured = property(lambda self: self.admission.measured)
    capacity = property(lambda self: self.admission.capacity)
    max_held_bytes = property(lambda self: self.admission.max_held_bytes)
    max_lease_bytes = property(lambda self: self.admission.max_lease_bytes)

    def load(self) -> int:
        """Groups queued, being generated, or being trained: what admission control bounds."""
        return self.admission.load()

    # ------------------------------------------------------------------ spool
    def _recover(self, rec: sp.Recovered) -> None:
        acked = {gid for entries in rec.uncommitted.values() for _, gid in entries}
        self.q.restore(rec.groups)
        self.batches.restore(rec)
        for gid in rec.groups:
            if gid not in acked:
                self.q.enqueue(gid)
        self.q.restore_seen(rec.seen)
        self.prompts.seek(rec.epoch, rec.pos)
        for p in rec.open_prompts.values():
            self.prompts.requeue(p)
        self.controls.restore(rec)
        if rec.records:
            log.info(
                "recovered from the spool: %d records, %d queued groups, %d uncommitted, %d open prompts, version %d%s",
                rec.records,
                len(self.q),
                len(acked),
                len(rec.open_prompts),
                self.version,
                f"; skipped {rec.skipped_bytes} damaged bytes in {rec.damaged} region(s), quarantined"
                if rec.damaged
                else "",
            )
        self.recovery = {
            "records_kept": rec.records,
            "bytes_skipped": rec.skipped_bytes,
            "regions_quarantined": rec.damaged,
        }
        if rec.needs_rewrite and self.spool is not None:  # damage inside the log: rewrite it, next replay starts clean
            self.spool.compact(self.snapshot())

    def snapshot(self) -> list[sp.Record]:
        """The live state as spool records (compaction)."""
        recs: list[sp.Record] = [self.controls.version_record()]
        open_prompts = [p for lease in self.prompts.leases.values() for p in lease.prompts.values()]
        recs.append(sp.PromptsLeased(open_prompts, self.prompts.epoch, self.prompts.pos))
        recs.append(sp.PromptsRequeued(list(self.prompts.reissue)))
        recs.extend(sp.GroupAccepted(g) for g in self.q.groups.values())
        for client, entries in self.batches.uncommitted.items():
            for step, gid in entries:
                recs.append(sp.GroupsAcked(client, step, [gid]))
        recs.append(sp.SeenIds(list(self.q.seen)[-sp.SEEN_WINDOW :]))
        recs.extend(sp.VersionsDiscarded(lo, hi) for lo, hi in self.controls.discarded.ranges())
        recs.extend(sp.BatchLeased(lid, lease.client_id, lease.group_ids) for lid, lease in self.batches.leases.items())
        return recs

    # ------------------------------------------------------------- dispatch
    def handle(self, req: m.Request, now: float, principal: Principal | None = None) -> m.Message | None:
        """Authorize and apply one request; returns its reply, or None for a LeaseBatch that should wait.

        ``principal`` is the key behind the request (None: a trusted in-process caller, e.g. a test of
        the state machine; unauthenticated: the server without CURVE, roles from Register)."""
        handler = getattr(self, "_on_" + type(req).__name__, None)
        if handler is None:  # pragma: no cover - every Request type has a handler
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"no handler for {type(req).__name__}")
        role = None
        self.key = principal.identity if principal is not None and principal.authenticated else ""
        if isinstance(req, RATE_LIMITED) and not self.limiter.allow(self.key or req.client_id, now):
            return self._throttle_key(req, now)
        if principal is not None:
            refusal, role = self._check(req, now, principal)
            if refusal is not None:
                return refusal
        try:
            reply = handler(req, now, role=role)
        except sp.SpoolUnavailable as e:
            return m.Error(
                req_id=req.req_id,
                code="unavailable",
                reason=(f"the broker's spool cannot be written ({e}); nothing was changed: retry later"),
            )
        except Unauthorized as e:
            return self._refuse(req, principal, role or "?", str(e))
        if isinstance(req, AUDITED) and reply is not None:
            self._audit_request(req, principal, role, reply)
        if isinstance(reply, m.Registered) and principal is not None and principal.authenticated:
            reply.identity = principal.identity
        return reply

    def _throttle_key(self, req: m.Request, now: float) -> m.Error:
        """A key over broker.key_requests_per_s: `unavailable` (clients back off), one audit line per window."""
        key = self.key or req.client_id
        self.counters["key_throttled"] += 1
        refused = self.limiter.audit_due(key, now)
        if refused:
            self._audit_event(
                {"event": "key_throttled", "key": key, "refused": refused, "limit_per_s": self.bcfg.key_requests_per_s}
            )
        return m.Error(
            req_id=req.req_id,
            code="unavailable",
            reason=(
                f"{'key' if self.key else 'client'} {key!r} sends more than broker.key_requests_per_s="
                f"{self.bcfg.key_requests_per_s:g} Register/GetStatus/GetVersion requests a second; retry later"
            ),
        )

    def _check(self, req: m.Request, now: float, principal: Principal) -> tuple[m.Error | None, str | None]:
        """(refusal, role): the permission table, and a client record for every request but a few."""
        client = self.clients.get(req.client_id) if req.client_id else None
        if principal.authenticated:
            role = principal.role
        elif isinstance(req, m.Register):
            role = req.role
        else:
            role = client.role if client is not None else "unregistered"
        if client is None and not isinstance(req, REGISTRATION_FREE):
            self.rejected["unregistered"] += 1
            return m.Error(
                req_id=req.req_id,
                code="unregistered",
                reason=(
                    f"the broker holds no record of client {req.client_id!r} (it restarted, or evicted a silent client); "
                    "send Register again"
                ),
            ), role
        reason = authorize(principal, role, req, self.version)
        if reason is None:
            return None, role
        return self._refuse(req, principal, role, reason), role

    def _refuse(self, req: m.Request, principal: Principal | None, role: str, reason: str) -> m.Error:
        self.rejected["unauthorized"] += 1
        self.counters[f"refused/{type(req).__name__}"] += 1
        self._audit_event(
            {
                "event": "refused",
                "request": type(req).__name__,
                "client_id": req.client_id,
                "identity": principal.identity if principal else "",
                "role": role,
                "reason": reason,
            }
        )
        return m.Error(req_id=req.req_id, code="unauthorized", reason=reason)

    def _audit_request(self, req: m.Request, principal: Principal | None, role: str | None, reply: m.Message) -> None:
        fields = {f: getattr(req, f) for f in req.__struct_fields__ if f not in ("req_id", "client_id", "weights")}
        if isinstance(req, m.PublishVersion):
            fields["transport"] = req.weights.transport
        outcome = reply.code if isinstance(reply, m.Error) else "ok"
        self._audit_event(
            {
                "event": type(req).__name__,
                "client_id": req.client_id,
                "outcome": outcome,
                "identity": principal.identity if principal and principal.authenticated else req.client_id,
                "role": role or "trusted",
                **fields,
            }
        )

    def _audit_event(self, record: dict[str, Any]) -> None:
        if self.audit is not None:
            self.audit({"time": self.wall(), **record})

    def _touch(self, client_id: str, now: float, role: str = "", version: int | None = None) -> ClientState:
        c = self.clients.get(client_id) or self.clients.create(client_id, role, now)
        self.clients.seen(c, now)
        if version is not None:
            c.policy_version = version
        return c

    # ------------------------------------------------------------- clients
    def _on_Register(self, req: m.Register, now: float, role: str | None = None) -> m.Message:
        if req.protocol != m.PROTOCOL_VERSION:
            self.rejected["protocol_mismatch"] += 1
            return m.Error(
                req_id=req.req_id,
                code="protocol_mismatch",
                reason=f"client speaks protocol {req.protocol}, broker {m.PROTOCOL_VERSION}; install matching fleetrl versions",
            )
        too_large = self.clients.too_large(req.info, "Register.info")
        if too_large:
            self.rejected["too_large"] += 1
            return m.Error(req_id=req.req_id, code="too_large", reason=too_large)
        bad = receivers_error(req.info)
        if bad:
            self.rejected["bad_request"] += 1
            return m.Error(req_id=req.req_id, code="bad_request", reason=bad)
        shown = req.role if role is None or req.role == "monitor" else role
        c = ClientState(req.client_id, shown, self.key, req.rank, info=dict(req.info))
        if shown == "rollout" and self.controls.version_known:
            c.admit_from = self.version  # a (re)started rollout leases once it holds the current weights
        full = self.clients.register(c, now)
        if full:
            self.rejected["too_many_clients"] += 1
            return m.Error(req_id=req.req_id, code="unavailable", reason=full)
        if shown == "learner":
            self.leases_ahead = 0  # until it leases ahead (a restarted learner may not prefetch)
        if shown == "learner" and self.learner_done:
            log.info("learner %s registered: training goes on after `done` (%s)", req.client_id, self.learner_done)
            self.learner_done = ""
        return m.Registered(
            req_id=req.req_id,
            broker_id=self.broker_id,
            policy_version=self.version,
            vocab_size=self.vocab_size,
            heartbeat_s=self.bcfg.heartbeat_s,
            weights=self.controls.weights_for(role or shown),
            paused=self.paused,
            pub_port=self.pub_port,
            max_message_bytes=self.bcfg.max_message_bytes,
            max_groups_per_push=self.bcfg.max_groups_per_push,
            role=role or shown,
        )

    def _on_Heartbeat(self, req: m.Heartbeat, now: float, role: str | None = None) -> m.Message:
        too_large = self.clients.too_large(req.stats, "Heartbeat.stats")
        if too_large:
            self.rejected["too_large"] += 1
            return m.Error(req_id=req.req_id, code="too_large", reason=too_large)
        c = self._touch(req.client_id, now, version=req.policy_version)
        if not self.clients.set_stats(c, dict(req.stats)):
            self.counters["stats_dropped"] += 1
        return m.Ack(req_id=req.req_id, ref=req.client_id)

    # ------------------------------------------------------------- rollout side
    def _on_LeasePrompts(self, req: m.LeasePrompts, now: float, role: str | None = None) -> m.Message:
        c = self._touch(req.client_id, now, "rollout", req.policy_version)
        if req.n <= 0:
            return m.Error(
                req_id=req.req_id, code="bad_request", reason=f"LeasePrompts.n must be positive, got {req.n}"
            )
        throttle = self._lease_throttle(req, c, now)
        if throttle is not None:
            self.counters["throttled"] += 1
            return m.Throttle(req_id=req.req_id, retry_after_s=throttle[0], reason=throttle[1])
        c.admit_from = 0
        mark = self.prompts.mark()
        room = self._share_room(now)
        free = self.admission.room(staleness(self.version, req.policy_version), self.leases_ahead)
        prompts = self.prompts.take(min(req.n, free, req.n if room is None else room))
        if not prompts:
            if self.prompts.exhausted and not self.prompts.leases:
                return m.Error(
                    req_id=req.req_id,
                    code="data_exhausted",
                    reason=f"all {self.prompts.epochs} epoch(s) of the prompt set were served; raise data.epochs",
                )
            return m.Throttle(req_id=req.req_id, retry_after_s=1.0, reason="waiting for leased prompts to come back")
        prompts, rest = fit_bytes(prompts, self.max_lease_bytes)
        try:
            self.journal.write(
                [sp.PromptsLeased(prompts, self.prompts.epoch, self.prompts.pos)]
                + ([sp.PromptsRequeued(rest)] if rest else [])
            )
        except sp.SpoolUnavailable:
            self.prompts.untake(mark, prompts + rest)
            raise
        self.prompts.put_back(rest)
        lease = self.prompts.open_lease(req.client_id, prompts, now, self.bcfg.prompt_lease_s, self.key)
        self.counters["prompts_leased"] += len(prompts)
        return m.PromptLease(
            req_id=req.req_id,
            lease_id=lease.lease_id,
            prompts=prompts,
            expires_in_s=self.bcfg.prompt_lease_s,
            policy_version=self.version,
        )

    def _lease_throttle(self, req: m.LeasePrompts, c: ClientState, now: float) -> tuple[float, str] | None:
        """(retry_after_s, reason) when this rollout gets no prompts now."""
        ctl = self.controls
        if self.paused or ctl.stopping:
            return 1.0, "stopping" if ctl.stopping else "paused"
        if c.client_id in ctl.quarantined:
            return 5.0, (
                f"quarantined: {ctl.quarantined[c.client_id]}; an operator lifts it with `fleetrl control release "
                f"--target {c.client_id}`"
            )
        if self.learner_done:  # nobody trains on new groups: say so (a server that missed `done` learns it here)
            return 2.0, f"done: {self.learner_done}"
        if ctl.version_known and req.policy_version > self.version + self.bcfg.version_slack:
            return 1.0, (
                f"policy version {req.policy_version} is ahead of the broker's {self.version}; "
                "load the version the broker announces"
            )
        if req.policy_version < c.admit_from:
            return 0.5, (
                f"a rollout that (re)joined leases once it holds the current weights (version {c.admit_from}); "
                f"it holds {req.policy_version}"
            )
        if not rollout_is_fresh(self.version, req.policy_version, self.bcfg.max_staleness):
            return 0.2, f"policy version {req.policy_version} is too stale (current {self.version}); load new weights"
        lag = staleness(self.version, req.policy_version)
        if self.admission.room(lag, self.leases_ahead) <= 0:
            if self.key:
                self.shares.starved(self.key, now)
            if lag and self.admission.room(0, self.leases_ahead) > 0:  # room for fresher weights: they are on the way
                return 0.05, f"at capacity for weights {lag} version(s) behind ({self.version}); load new weights"
            return 0.1, f"at capacity ({self.capacity} groups)"
        if self._share_room(now) == 0:
            self.counters["prompt_share_throttled"] += 1
            return 0.2, (
                f"key {self.key!r} holds {self.prompts.held_by_key[self.key]} leased prompts, its share of "
                "the capacity while other keys wait for prompts (broker.fair_prompt_share)"
            )
        return None

    def _share_room(self, now: float) -> int | None:
        """How many more prompts this request's key may hold (fairness.PromptShares), or None: no share applies."""
        if not (self.key and self.bcfg.fair_prompt_share):
            return None
        share = self.shares.share(self.key, self.prompts.held_by_key, self.capacity, now)
        return None if share is None else max(0, share - self.prompts.held_by_key[self.key])

    def _on_ReturnPrompts(self, req: m.ReturnPrompts, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now)
        lease = self.prompts.leases.get(req.lease_id)
        if lease is None:
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=0)
        if role is not None and lease.client_id != req.client_id:
            raise Unauthorized(f"prompt lease {req.lease_id} is held by {lease.client_id}, not {req.client_id}")
        ids = list(dict.fromkeys(req.prompt_ids)) or list(lease.prompts)  # a repeated id is returned once
        if req.unscored:  # no reward could score them: re-issuing would only score nothing again
            returned = [i for i in ids if i in lease.prompts]
            for pid in returned:
                self.prompts.fulfil(pid)
            self.counters["prompts_unscored"] += len(returned)
            return m.Ack(req_id=req.req_id, ref=req.lease_id, count=len(returned))
        self.journal.write([sp.PromptsRequeued([lease.prompts[i] for i in ids if i in lease.prompts])])
        n = self.prompts.give_back(req.lease_id, ids)
        return m.Ack(req_id=req.req_id, ref=req.lease_id, count=n)

    def _on_PushGroup(self, req: m.PushGroup, now: float, role: str | None = None) -> m.Message:
        ((status, reason, _),) = self.ingest.push([req.group], self._touch(req.client_id, now, "rollout"), now)
        if status == "rejected":
            return m.Error(req_id=req.req_id, code="invalid_group", reason=reason)
        if status == "throttled":
            return m.Throttle(req_id=req.req_id, retry_after_s=1.0, reason=reason)
        return m.Ack(
            req_id=req.req_id, ref=req.group.group_id, count=int(status == "accepted"), duplicate=status == "duplicate"
        )

    def _on_PushGroups(self, req: m.PushGroups, now: float, role: str | None = None) -> m.Message:
        if len(req.groups) > self.bcfg.max_groups_per_push:
            self.rejected["too_many_groups"] += 1
            return m.Error(
                req_id=req.req_id,
                code="too_large",
                reason=(
                    f"{len(req.groups)} groups in one PushGroups, over broker.max_groups_per_push="
                    f"{self.bcfg.max_groups_per_push}; push them in several frames"
                ),
            )
        results = self.ingest.push(req.groups, self._touch(req.client_id, now, "rollout"), now)
        return m.GroupAcks(
            req_id=req.req_id,
            acks=[
                m.GroupAck(group_id=g.group_id, status=cast(AckStatus, s), reason=r, code=code)
                for g, (s, r, code) in zip(req.groups, results)
            ],
        )

    def drop(self, gids: list[str], reason: str, requeue_prompts: bool, also: list[sp.Record] | None = None) -> None:
        """Forget groups for good, maybe re-issuing their prompts; spooled first, with ``also`` in the same write."""
        prompts = [
            p
            for gid in gids
            if requeue_prompts
            and (g := self.q.groups.get(gid)) is not None
            and (p := self.prompts.lookup(g.prompt_id)) is not None
        ]
        self.journal.write(
            list(also or [])
            + ([sp.GroupsDone(gids)] if gids else [])
            + ([sp.PromptsRequeued(prompts)] if prompts else [])
        )
        self.q.forget(gids)
        self.counters[reason] += len(gids)
        for p in prompts:
            self.prompts.requeue(p)

    # ------------------------------------------------------------- learner side
    def _on_LeaseBatch(
        self, req: m.LeaseBatch, now: float, role: str | None = None, final: bool = False
    ) -> m.Message | None:
        """Fill a batch lease, dropping stale groups on the way; None = wait for more groups."""
        self._touch(req.client_id, now, "learner")
        if req.n <= 0:
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"LeaseBatch.n must be positive, got {req.n}")
        if req.for_version < 0:
            return m.Error(
                req_id=req.req_id,
                code="bad_request",
                reason=f"LeaseBatch.for_version must be >= 0 (0: the newest published version), got {req.for_version}",
            )
        if len(self.q) < min(req.min_groups, req.n) and not final and req.wait_s > 0:
            return None
        trained_at = max(self.version, req.for_version)  # a learner leasing ahead of its publish trains at it
        if req.for_version > self.version:
            self.leases_ahead = min(1, req.for_version - self.version)
        ids, stale = self.batches.take(
            req.n, min_fresh_version(trained_at, self.bcfg.max_staleness), self.max_lease_bytes
        )
        if stale:
            try:
                self.drop(stale, "dropped_stale", self.bcfg.requeue_stale)
            except sp.SpoolUnavailable:
                self.q.requeue_front(stale)  # dropped on a later lease, once the spool is writable
        if not ids:
            if not final and req.wait_s > 0:
                return None
            return m.Throttle(req_id=req.req_id, retry_after_s=0.2, reason="no fresh groups queued yet")
        for gid in ids:
            self.staleness_hist[staleness(trained_at, self.q.groups[gid].policy_version)] += 1
        lease = self.batches.open(req.client_id, ids, now)
        self.rate_out.add(now, len(ids))
        if self.measured is not None:
            self.measured.taken_by_learner(len(ids))
        return m.BatchLease(
            req_id=req.req_id,
            lease_id=lease.lease_id,
            groups=[self.q.groups[g] for g in ids],
            expires_in_s=self.bcfg.batch_lease_s,
            dropped_stale=len(stale),
        )

    def lease_batch_final(self, req: m.LeaseBatch, now: float) -> m.Message:
        """Answer a waiting LeaseBatch at its deadline with whatever is there."""
        return self._on_LeaseBatch(req, now, final=True)  # type: ignore[return-value]

    def _on_AckBatch(self, req: m.AckBatch, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now, "learner")
        lease = self.batches.leases.get(req.lease_id)
        held = len(lease.group_ids) if lease is not None and lease.client_id == req.client_id else 0
        ack = self.batches.ack(req, now)
        closes = not (req.keep_rest and req.group_ids)
        if self.measured is not None and held and closes and ack.count < held:
            # groups the learner leased and gave back untrained (requeued): not consumed by this version
            self.measured.taken_by_learner(ack.count - held)
        return ack

    def _on_Commit(self, req: m.Commit, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now, "learner")
        return self.batches.commit(req)

    def _on_Rewind(self, req: m.Rewind, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now, "learner")
        if req.step < 0:
            return m.Error(req_id=req.req_id, code="bad_request", reason=f"Rewind.step must be >= 0, got {req.step}")
        return self.batches.rewind(req)

    # ------------------------------------------------------------- versions and control: control.py
    def _on_PublishVersion(self, req: m.PublishVersion, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now, "learner", req.version)
        return self.controls.publish(req)

    def _on_Control(self, req: m.Control, now: float, role: str | None = None) -> m.Message:
        self._touch(req.client_id, now)
        return self.controls.control(req, role)

    def _on_GetVersion(self, req: m.GetVersion, now: float, role: str | None = None) -> m.Message:
        if req.client_id and self.clients.get(req.client_id) is not None:
            self._touch(req.client_id, now)
        return m.CurrentVersion(
            req_id=req.req_id,
            version=self.version,
            step=self.controls.version_step,
            weights=self.controls.weights_for(role),
            paused=self.paused,
        )

    def _on_GetStatus(self, req: m.GetStatus, now: float, role: str | None = None) -> m.Message:
        return self.status(req.req_id, now)

    def _on_Leave(self, req: m.Leave, now: float, role: str | None = None) -> m.Message:
        """A graceful exit: the client leaves the fleet at once (no wait for broker.client_timeout_s); the prompts
        and batches it still held are re-issued now. ``done`` from a learner: training finished, announced."""
        client = self.clients.remove(req.client_id)
        who = client.role if client is not None else (role or "unknown")
        reissued = self._reissue(now, {req.client_id})  # prompts it still held (normally returned already)
        back = self.batches.release(req.client_id)
        if req.done and who == "learner":
            self.learner_done = req.reason or f"{req.client_id} finished"
            self.announcements.append((m.TOPIC_CONTROL, m.ControlAnnouncement(action="done", reason=self.learner_done)))
        log.info(
            "%s %s left (%s)%s%s",
            who,
            req.client_id,
            req.reason or "no reason given",
            f"; {reissued} prompt(s) re-issued" if reissued else "",
            f"; {back} group(s) requeued" if back else "",
        )
        return m.Ack(req_id=req.req_id, ref=req.client_id, count=reissued + back)

    def announce_shutdown(self, reason: str = "the broker is shutting down") -> None:
        """Tell every subscriber the job is over before the broker exits (rollouts started by hand then stop
        unless rollout.stay_after_done)."""
        self.announcements.append((m.TOPIC_CONTROL, m.ControlAnnouncement(action="done", reason=reason)))

    # ------------------------------------------------------------- timers
    def expire(self, now: float) -> dict[str, int]:
        """Re-issue expired prompt leases (and those of dead clients); redeliver expired batch leases; evict
        long-dead clients and lift the pause holds of dead learners."""
        dead = self.clients.dead(now)
        reissued = self._reissue(now, dead)
        self.counters["clients_evicted"] += len(self.clients.evict_dead(now))
        self.controls.lift_dead_holds(
            dead | {cid for cid in self.controls.pause_holds if self.clients.get(cid) is None}
        )
        return {"prompts_reissued": reissued, "groups_redelivered": self.batches.redeliver_expired(now)}

    def _reissue(self, now: float, clients: set[str]) -> int:
        """Re-issue expired prompt leases and those held by ``clients`` (journalled first); how many prompts."""
        expired = [
            lid for lid, lease in self.prompts.leases.items() if lease.expires_at <= now or lease.client_id in clients
        ]
        if not expired:
            return 0
        try:
            self.journal.write(
                [sp.PromptsRequeued([p for lid in expired for p in self.prompts.leases[lid].prompts.values()])]
            )
        except sp.SpoolUnavailable:
            return 0  # retried on the next tick
        reissued = sum(self.prompts.give_back(lid) for lid in expired)
        self.counters["prompts_reissued"] += reissued
        return reissued

    # ------------------------------------------------------------- status
    def status(self, req_id: int, now: float) -> m.Status:
        rows, omitted, stats_omitted = self.clients.rows(now, self.bcfg.max_status_bytes)
        return m.Status(
            req_id=req_id,
            broker_id=self.broker_id,
            uptime_s=now - self.started,
            policy_version=self.version,
            queue_depth=len(self.q),
            groups_in_flight=self.in_flight,
            prompts_leased=self.prompts.leased,
            groups_in=self.counters["groups_in"],
            groups_out=self.counters["groups_out"],
            groups_in_per_s=self.ingest.rate_in.per_s(now),
            groups_out_per_s=self.rate_out.per_s(now),
            dropped_stale=self.counters["dropped_stale"],
            duplicates=self.counters["duplicates"],
            rejected=dict(self.rejected),
            staleness_hist={str(k): v for k, v in sorted(self.staleness_hist.items())},
            clients=rows,
            clients_omitted=omitted,
            stats_omitted=stats_omitted,
            paused=self.paused,
            data_epoch=self.prompts.epoch,
            data_cursor=self.prompts.pos,
            throttled=self.counters["throttled"],
            uncommitted=sum(len(e) for e in self.uncommitted.values()),
            counters={k: v for k, v in self.counters.items() if k not in STATUS_FIELDS and v},
            stats={**self.status_stats(now), "broker/capacity": float(self.capacity)},
            quarantined=dict(self.controls.quarantined),
        )


STATUS_FIELDS = {"groups_in", "groups_out", "dropped_stale", "duplicates", "throttled"}
