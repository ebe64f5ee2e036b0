"""`fleetrl broker`: the ZeroMQ front of :class:`~fleetrl.broker.server.state.BrokerState`.

One ROUTER socket takes requests from every rollout server and learner rank (DEALER sockets); one
PUB socket announces new policy versions and control actions. The hot path drains every frame that
is ready, applies them to the state (each request's records reach the OS before the state changes),
fsyncs once per batch with ``broker.fsync: always``, then sends the replies.

Security (docs/broker.md#security): without CURVE only a loopback bind is allowed (or
``broker.insecure_bind``); with CURVE the allowlist maps each key to a role and identity, which
ride with every frame (``User-Id``) into the permission table. Resources: ZMTP heartbeats and a
handshake timeout on every connection, the connection guard (``guard.py``) against unfinished
frames and idle descriptors, what is too large refused before it is decoded (``security/precheck.py``: frame
sizes, groups per push, a group's metadata in bytes), and long polls woken by arriving groups rather
than re-run on a timer.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import cast

import zmq
import zmq.auth

from fleetrl.broker.security import auth
from fleetrl.broker.security.audit import AuditLog
from fleetrl.broker.security.guard import Guard
from fleetrl.broker.security.precheck import detach_if_pinning, precheck
from fleetrl.broker.server.prompts import PromptSource, rows_to_prompts
from fleetrl.broker.server.rates import WireStats
from fleetrl.broker.server.spool import Spool
from fleetrl.broker.server.state import BrokerState
from fleetrl.broker.zio import LoopSocket
from fleetrl.common import messages as m
from fleetrl.common.config import load_config, save_resolved
from fleetrl.common.config.schema import CurveConfig, JobConfig
from fleetrl.common.data.tables import load_rows
from fleetrl.common.telemetry import tracing
from fleetrl.common.telemetry.logs import setup_logging
from fleetrl.common.telemetry.startup import STARTUP

log = logging.getLogger("fleetrl.broker")

TICK_S = 0.05
GUARD_S = 0.05  # how often the connection guard looks (every tick)
MAX_WAIT_S = (
    60.0  # longest a LeaseBatch is held: a larger wait_s (inf included) is cut to it, so every request is answered
)
PUB_ROLES = ("rollout", "learner", "operator")  # who may subscribe to announcements (they carry round secrets)


def read_vocab_size(cfg: JobConfig) -> int:
    """broker.vocab_size, else ``vocab_size`` from the model's config.json (0 = unknown: no id check)."""
    if cfg.broker.vocab_size:
        return cfg.broker.vocab_size
    path = Path(cfg.model.path) / "config.json"
    try:
        return int(json.loads(path.read_text()).get("vocab_size") or 0)
    except (OSError, ValueError):
        return 0


def build_state(cfg: JobConfig, audit=None) -> BrokerState:
    prompts = PromptSource(
        rows_to_prompts(
            load_rows(cfg.data.train, "data.train", cfg.data), cfg.data.prompt_key, cfg.data.answer_key, cfg.data.train
        ),
        cfg.data.shuffle,
        cfg.data.seed,
        cfg.data.epochs,
    )
    spool = Spool(cfg.broker.spool_dir, cfg.broker.fsync, cfg.broker.fsync_interval_s) if cfg.broker.spool_dir else None
    return BrokerState(cfg, prompts, read_vocab_size(cfg), spool, audit=audit)


class Waiting:
    """Long polls (LeaseBatch with wait_s) held until groups arrive or their deadline; a heap by deadline."""

    def __init__(self):
        self.heap: list[tuple[float, int, bytes, m.LeaseBatch, object, int]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, deadline: float, ident: bytes, req: m.LeaseBatch, principal, fd: int) -> None:
        heapq.heappush(self.heap, (deadline, next(self._seq), ident, req, principal, fd))

    def due(self, now: float) -> list[tuple]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            out.append(heapq.heappop(self.heap))
        return out

    def take_all(self) -> list[tuple]:
        out, self.heap = sorted(self.heap, key=lambda w: w[1]), []
        return out

    def fds(self) -> set[int]:
        return {w[5] for w in self.heap}


class BrokerServer:
    def __init__(self, cfg: JobConfig, state: BrokerState, ctx: zmq.Context | None = None):
        self.cfg, self.state = cfg, state
        self.ctx = ctx or zmq.Context()
        self.router: LoopSocket | None = None
        self.pub: zmq.Socket | None = None
        self.auth: auth.RoleAuthenticator | None = None
        self.guard: Guard | None = None
        self.waiting = Waiting()
        self.address = self.pub_address = ""
        self._stop = asyncio.Event()
        self._next_guard = 0.0
        self._guard_chain = False  # a 10 ms guard chain is running (connections under pressure)
        self.wire = WireStats()
        state.status_stats = self.wire.stats

    # -------------------------------------------------------------- sockets
    def _bind(self, sock: zmq.Socket, port: int) -> str:
        host = self.cfg.broker.host
        sock.bind(f"tcp://{host}:{port}" if port else f"tcp://{host}:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _curve(self, sock: zmq.Socket, domain: bytes) -> None:
        curve = cast(CurveConfig, self.cfg.broker.curve)  # set: the broker runs CURVE
        public, secret = zmq.auth.load_certificate(curve.server_secret_key)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        sock.zap_domain = domain

    def _security(self) -> None:
        """Refuse an unsafe start (see auth.check_bind, auth.load_key_table), start the ZAP handler."""
        bcfg = self.cfg.broker
        warning = auth.check_bind(bcfg)
        if warning:
            log.warning(warning)
        if bcfg.curve is None:
            return
        auth.check_secret_file(bcfg.curve.server_secret_key, "broker.curve.server_secret_key")
        table = auth.load_key_table(bcfg.curve.authorized_keys_dir)
        self.auth = auth.RoleAuthenticator(self.ctx, table, self._refused_key, PUB_ROLES)
        self.auth.start()
        roles = sorted({e.role for e in table.values()})
        log.info(
            "CURVE on: %d client keys in %s (roles: %s)", len(table), bcfg.curve.authorized_keys_dir, ", ".join(roles)
        )

    def _refused_key(self, key: str, domain: str) -> None:
        self.state.counters["keys_refused"] += 1
        self.state._audit_event({"event": "key_refused", "key": key, "socket": domain})

    def _options(self, router: zmq.Socket) -> None:
        bcfg = self.cfg.broker
        router.setsockopt(zmq.MAXMSGSIZE, 2 * bcfg.max_message_bytes)
        router.setsockopt(zmq.RCVHWM, 100_000)
        router.setsockopt(zmq.SNDHWM, 100_000)
        for sock in (router, cast(zmq.Socket, self.pub)):  # made just before
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(bcfg.zmq_heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * bcfg.zmq_heartbeat_s * 1000))
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(bcfg.handshake_timeout_s * 1000))

    async def start(self) -> None:
        """Check the security settings, bind both sockets (with the ZAP handler under CURVE); cleans up if any
        step fails."""
        router = None
        try:
            bcfg = self.cfg.broker
            self._security()
            open_files = auth.raise_open_files_limit()
            router = self.ctx.socket(zmq.ROUTER)
            self.pub = self.ctx.socket(zmq.PUB)
            for sock, domain in ((router, b"requests"), (self.pub, b"pub")):
                sock.linger = 0
                if bcfg.curve is not None:
                    self._curve(sock, domain)
            self._options(router)
            self.guard = Guard.attach(router, bcfg, self.state.counters, open_files)
            self.address = self._bind(router, bcfg.port)
            self.pub_address = self._bind(self.pub, bcfg.pub_port)
            self.state.pub_port = int(self.pub_address.rsplit(":", 1)[1])
            self.router = LoopSocket(router, self._on_batch, copy=False)
        except Exception:
            if router is not None and self.router is None:
                router.close(linger=0)
            self.close()
            raise
        log.info(
            "broker %s serving requests on %s, announcements on %s (capacity %d groups, max_staleness %d%s)",
            self.state.broker_id,
            self.address,
            self.pub_address,
            self.state.capacity,
            self.cfg.broker.max_staleness,
            ", CURVE on" if self.cfg.broker.curve else "",
        )

    def close(self) -> None:
        if self.guard is not None:
            if self.router is not None:
                try:
                    self.router.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self.guard.close()
            self.guard = None
        if self.router is not None:
            self.router.close()
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.state.spool is not None:
            self.state.spool.close()

    # -------------------------------------------------------------- serving
    def _principal(self, frame: zmq.Frame) -> auth.Principal:
        if self.auth is None:
            return auth.UNAUTHENTICATED
        try:
            return auth.principal_of(cast(str, frame.get("User-Id")))
        except zmq.ZMQError:  # pragma: no cover - every CURVE frame carries one
            return auth.Principal("?", "unknown")

    def _handle_frames(self, frames: list[zmq.Frame], now: float) -> tuple[bytes, m.Message | None]:
        """One request: frames are [client identity, payload]; groups decode as views into the payload."""
        ident = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        self.wire.received(sum(len(f) for f in frames[1:]), now)
        if self.guard is not None:
            self.guard.delivered(fd, sum(len(f) for f in frames[1:]), now)
        if len(frames) != 2:
            self.state.rejected["bad_frame"] += 1
            return ident, m.Error(
                req_id=0, code="bad_frame", reason=f"expected one payload frame, got {len(frames) - 1}"
            )
        payload = frames[1].buffer
        header = m.peek_header(payload)
        req_id = header[1] if header else 0
        refusal = precheck(payload, header, req_id, self.cfg.broker)
        if refusal is not None:
            self.state.rejected[refusal[0]] += 1
            return ident, refusal[1]
        try:
            req = m.decode_request(payload)
        except m.ProtocolError as e:
            code: m.ErrorCode = "invalid_group" if header and header[0] in m.PUSH_GROUP_TAGS else "bad_frame"
            self.state.rejected[code] += 1
            return ident, m.Error(req_id=req_id, code=code, reason=e.reason)
        if isinstance(req, (m.PushGroup, m.PushGroups)):
            detach_if_pinning(req, len(payload))
        start_ns = time.time_ns() if tracing.enabled() else 0
        principal = self._principal(frames[1])
        try:
            reply = self.state.handle(req, now, principal)
        except Exception as e:  # noqa: BLE001 - a bug must not take the broker down; the request is answered
            log.exception("internal error on %s", type(req).__name__)
            self.state.rejected["internal"] += 1
            return ident, m.Error(req_id=req.req_id, code="internal", reason=f"{type(e).__name__}: {e}")
        if reply is None:  # a LeaseBatch that waits for groups
            lease = cast(m.LeaseBatch, req)
            if len(self.waiting) >= self.cfg.broker.max_waiting_polls:
                self.state.rejected["too_many_waiting"] += 1
                return ident, self.state.lease_batch_final(lease, now)
            self.waiting.add(now + min(lease.wait_s, MAX_WAIT_S), ident, lease, principal, fd)
        elif start_ns and isinstance(req, (m.PushGroup, m.PushGroups)):
            trace_ingest(req, reply, start_ns)
        return ident, reply

    def _serve_waiting(self, now: float) -> list[tuple[bytes, m.Message]]:
        """Answer the long polls: at their deadline, and all of them when groups arrived."""
        out = []
        for w in self.waiting.due(now):
            out.append((w[2], self.state.lease_batch_final(w[3], now)))
            self._answered(w[5], now)
        if self.state.q.grew and len(self.waiting):
            self.state.q.grew = False
            for deadline, _, ident, req, principal, fd in self.waiting.take_all():
                reply = self.state.handle(req, now, principal)
                if reply is None:
                    self.waiting.add(deadline, ident, req, principal, fd)
                else:
                    out.append((ident, reply))
                    self._answered(fd, now)
        self.state.q.grew = False
        return out

    def _answered(self, fd: int, now: float) -> None:
        if self.guard is not None:
            self.guard.touch(fd, now)  # a connection whose long poll was just answered is not idle

    def _send(self, replies: list[tuple[bytes, m.Message]]) -> None:
        spool = self.state.spool
        if spool is not None:
            try:
                spool.flush()  # fsync: always -> before any ack leaves
            except OSError as e:
                self.state.counters["fsync_errors"] += 1
                log.error("spool fsync failed (%s); the records reached the OS but may not survive a machine crash", e)
        now = time.monotonic()
        router, pub = cast(LoopSocket, self.router), cast(zmq.Socket, self.pub)  # serving: both bound
        for ident, reply in replies:
            payload = m.encode(reply)
            router.send([ident, payload])
            self.wire.sent(len(payload), now)
            if isinstance(reply, m.BatchLease) and tracing.enabled():
                trace_batch_lease(reply)
        for topic, ann in self.state.announcements:
            payload = m.encode(ann)
            pub.send_multipart([topic, payload])
            self.wire.sent(len(payload), now)
        self.state.announcements.clear()

    def _on_batch(self, batch: list[list[zmq.Frame]]) -> None:
        """Every frame that was ready: apply them all, then reply (records reached the OS request by request)."""
        now = time.monotonic()
        replies = []
        for frames in batch:
            ident, reply = self._handle_frames(frames, now)
            if reply is not None:
                replies.append((ident, reply))
        replies.extend(self._serve_waiting(now))
        self._send(replies)

    async def serve(self) -> None:
        timer = asyncio.create_task(self._timers())
        try:
            await self._stop.wait()
        finally:
            timer.cancel()

    async def _timers(self) -> None:
        """Every tick: expiry, due long polls, fsync, compaction, the connection guard. An exception is logged,
        counted and the next tick runs anyway: the timer never dies."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - timers must survive anything; the broker keeps serving
                self.state.counters["timer_errors"] += 1
                log.exception(
                    "broker timer tick failed (%d so far); retrying on the next tick",
                    self.state.counters["timer_errors"],
                )

    def tick(self, now: float) -> None:
        self.state.expire(now)
        replies = self._serve_waiting(now)
        spool = self.state.spool
        if spool is not None:
            spool.sync_if_due()
            if spool.needs_compaction():
                try:
                    spool.compact(self.state.snapshot())
                except Exception as e:  # noqa: BLE001 - SpoolUnavailable: the old segments stay, retried later
                    self.state.counters["compaction_errors"] += 1
                    log.error("spool compaction failed (%s); keeping the current segment, retrying later", e)
        if self.guard is not None and now >= self._next_guard:
            self._next_guard = now + GUARD_S
            self._guard_now()
        self._send(replies)

    def _guard_now(self, chained: bool = False) -> None:
        """The connection guard; while connections hold much, again every 10 ms (a flood fills fast)."""
        if self.guard is None or (self._guard_chain and not chained):
            return
        self.guard.check(time.monotonic(), self.waiting.fds())
        self._guard_chain = self.guard.under_pressure
        if self._guard_chain:
            asyncio.get_running_loop().call_later(0.01, self._guard_now, True)

    def stop(self) -> None:
        self._stop.set()

    def announce_shutdown(self) -> None:
        """`done` to every subscriber before the sockets close: rollouts started by hand exit cleanly (unless
        rollout.stay_after_done) instead of retrying a broker that is gone."""
        if self.pub is None or self.router is None:
            return
        self.state.announce_shutdown()
        self._send([])
        time.sleep(0.2)  # the PUB socket's I/O thread puts it on the wire before close(linger=0) drops it


def trace_ingest(req: m.PushGroup | m.PushGroups, reply: m.Message, start_ns: int) -> None:
    """One ``broker.ingest`` span per pushed group that carries a sampled trace context, a child of it."""
    groups = req.groups if isinstance(req, m.PushGroups) else [req.group]
    if isinstance(reply, m.GroupAcks):
        statuses = [a.status for a in reply.acks]
    elif isinstance(reply, m.Ack):
        statuses = ["duplicate" if reply.duplicate else "accepted" if reply.count else "stale"]
    else:
        statuses = ["rejected"]
    end_ns = time.time_ns()
    for g, status in zip(groups, statuses):
        if tracing.sampled(g.trace):
            tracing.record_span(
                "broker.ingest",
                start_ns,
                end_ns,
                parent=g.trace,
                attributes={
                    "fleetrl.group_id": g.group_id,
                    "fleetrl.status": status,
                    "fleetrl.client_id": req.client_id,
                    "fleetrl.policy_version": g.policy_version,
                },
            )


def trace_batch_lease(reply: m.BatchLease) -> None:
    """A ``broker.batch_lease`` span in each sampled group's trace: the moment it left the queue for a learner."""
    now = time.time_ns()
    for g in reply.groups:
        if tracing.sampled(g.trace):
            tracing.record_span(
                "broker.batch_lease",
                now,
                now,
                parent=g.trace,
                attributes={
                    "fleetrl.group_id": g.group_id,
                    "fleetrl.lease_id": reply.lease_id,
                    "fleetrl.groups": len(reply.groups),
                    "fleetrl.policy_version": g.policy_version,
                },
            )


def write_endpoint_file(run_dir: str | Path, server: BrokerServer) -> Path:
    """``broker.json`` in the run dir: where clients connect (also the launcher's ready signal)."""
    path = Path(run_dir) / "broker.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "address": server.address,
                "pub_address": server.pub_address,
                "pid": os.getpid(),
                "broker_id": server.state.broker_id,
            }
        )
    )
    tmp.replace(path)
    return path


def open_audit(cfg: JobConfig, run_dir: str | None) -> AuditLog | None:
    path = cfg.broker.audit_log or (str(Path(run_dir) / "audit.jsonl") if run_dir else None)
    return AuditLog(path) if path else None


async def run_broker(cfg: JobConfig, run_dir: str | None) -> int:
    audit = open_audit(cfg, run_dir)
    state = build_state(cfg, audit)
    STARTUP.mark("prompts")
    # The broker holds many long-lived groups: freeze what start-up built and collect the young
    # generation less often, so the cyclic GC does not rescan the queue on every burst of frames.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    server = BrokerServer(cfg, state)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
    try:
        STARTUP.mark("bind")
        if run_dir:
            write_endpoint_file(run_dir, server)
        log.info("%s", STARTUP.line())
        await server.serve()
        server.announce_shutdown()
    finally:
        server.close()
        server.ctx.term()
        if audit is not None:
            audit.close()
        c = state.counters
        back = c["groups_out"] - c["groups_trained"]  # leased and given back untrained: a surplus, an expired lease
        log.info(
            "broker stopped: %d groups in, %d consumed by learners, %d still queued, %d dropped stale%s",
            c["groups_in"],
            c["groups_trained"],
            len(state.queued),
            c["dropped_stale"],
            f"; groups were handed out {c['groups_out']} times, {back} of them given back untrained"
            if back > 0
            else "",
        )
    return 0


def main(args) -> int:
    STARTUP.mark("python+imports")
    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if not (Path(run_dir) / "config.yaml").exists():
            save_resolved(cfg, run_dir)
    setup_logging("broker", cfg.telemetry.log_level)
    tracing.setup_tracing("broker", cfg.telemetry, run_dir, {"service.instance.id": "broker"})
    STARTUP.mark("config")
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        return asyncio.run(run_broker(cfg, run_dir))
    return uvloop.run(run_broker(cfg, run_dir))
