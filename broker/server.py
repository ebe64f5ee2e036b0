"""`fleetrl broker`: the ZeroMQ front of :class:`~fleetrl.broker.state.BrokerState`.

One ROUTER socket takes requests from every rollout server and learner rank (DEALER sockets); one
PUB socket announces new policy versions and control actions. The hot path drains every frame that
is ready, applies them to the state, hands the spool's records to the OS once, then sends the
replies — so a reply (an ack above all) never leaves before its record is written.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from fleetrl.broker.prompts import PromptSource, rows_to_prompts
from fleetrl.broker.spool import Spool
from fleetrl.broker.state import BrokerState
from fleetrl.broker.zio import LoopSocket
from fleetrl.common import messages as m
from fleetrl.common import telemetry
from fleetrl.common.config import ConfigError, load_config, save_resolved
from fleetrl.common.log import setup_logging
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.data.tables import load_rows

log = logging.getLogger("fleetrl.broker")

TICK_S = 0.05
MAX_WAIT_S = 60.0  # longest a LeaseBatch is held: a larger wait_s (inf included) is cut to it, so every request is answered


def read_vocab_size(cfg: JobConfig) -> int:
    """broker.vocab_size, else ``vocab_size`` from the model's config.json (0 = unknown: no id check)."""
    if cfg.broker.vocab_size:
        return cfg.broker.vocab_size
    path = Path(cfg.model.path) / "config.json"
    try:
        return int(json.loads(path.read_text()).get("vocab_size") or 0)
    except (OSError, ValueError):
        return 0


def build_state(cfg: JobConfig) -> BrokerState:
    prompts = PromptSource(
        rows_to_prompts(load_rows(cfg.data.train, "data.train", cfg.data), cfg.data.prompt_key, cfg.data.answer_key, cfg.data.train),
        cfg.data.shuffle, cfg.data.seed, cfg.data.epochs,
    )
    spool = Spool(cfg.broker.spool_dir, cfg.broker.fsync, cfg.broker.fsync_interval_s) if cfg.broker.spool_dir else None
    return BrokerState(cfg, prompts, read_vocab_size(cfg), spool)


class BrokerServer:
    def __init__(self, cfg: JobConfig, state: BrokerState, ctx: zmq.Context | None = None):
        self.cfg, self.state = cfg, state
        self.ctx = ctx or zmq.Context()
        self.router: LoopSocket | None = None
        self.pub: zmq.Socket | None = None
        self.auth = None
        self.waiting: list[tuple[bytes, m.LeaseBatch, float]] = []
        self.address = self.pub_address = ""
        self._stop = asyncio.Event()

    # -------------------------------------------------------------- sockets
    def _bind(self, sock: zmq.Socket, port: int) -> str:
        host = self.cfg.broker.host
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind(f"tcp://{host}:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _curve(self, sock: zmq.Socket) -> None:
        curve = self.cfg.broker.curve
        if not Path(curve.server_secret_key).is_file():
            raise ConfigError(f"broker.curve.server_secret_key={curve.server_secret_key!r} does not exist; "
                              "create keys with `fleetrl keys generate DIR`")
        public, secret = zmq.auth.load_certificate(curve.server_secret_key)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    async def start(self) -> None:
        """Bind both sockets (and the ZAP authenticator with CURVE); cleans up if any step fails."""
        router = None
        try:
            bcfg = self.cfg.broker
            if bcfg.curve is not None:
                self.auth = ThreadAuthenticator(self.ctx)
                self.auth.start()
                self.auth.configure_curve(domain="*", location=bcfg.curve.authorized_keys_dir or zmq.auth.CURVE_ALLOW_ANY)
            router = self.ctx.socket(zmq.ROUTER)
            self.pub = self.ctx.socket(zmq.PUB)
            for sock in (router, self.pub):
                sock.linger = 0
                if bcfg.curve is not None:
                    self._curve(sock)
            router.setsockopt(zmq.MAXMSGSIZE, 2 * bcfg.max_message_bytes)
            router.setsockopt(zmq.RCVHWM, 100_000)
            router.setsockopt(zmq.SNDHWM, 100_000)
            self.address = self._bind(router, bcfg.port)
            self.pub_address = self._bind(self.pub, bcfg.pub_port)
            self.state.pub_port = int(self.pub_address.rsplit(":", 1)[1])
            self.router = LoopSocket(router, self._on_batch, copy=False)
        except Exception:
            if router is not None and self.router is None:
                router.close(linger=0)
            self.close()
            raise
        log.info("broker %s serving requests on %s, announcements on %s (capacity %d groups, max_staleness %d%s)",
                 self.state.broker_id, self.address, self.pub_address, self.state.capacity, self.cfg.broker.max_staleness,
                 ", CURVE on" if self.cfg.broker.curve else "")

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        if self.state.spool is not None:
            self.state.spool.close()

    # -------------------------------------------------------------- serving
    def _handle_frames(self, frames: list[zmq.Frame], now: float) -> tuple[bytes, m.Message | None]:
        """One request: frames are [client identity, payload]; groups decode as views into the payload."""
        ident = frames[0].bytes
        if len(frames) != 2:
            self.state.rejected["bad_frame"] += 1
            return ident, m.Error(req_id=0, code="bad_frame", reason=f"expected one payload frame, got {len(frames) - 1}")
        payload = frames[1].buffer
        header = m.peek_header(payload)
        req_id = header[1] if header else 0
        if len(payload) > self.cfg.broker.max_message_bytes:
            self.state.rejected["too_large"] += 1
            return ident, m.Error(req_id=req_id, code="too_large", reason=(
                f"frame of {len(payload)} bytes is over broker.max_message_bytes={self.cfg.broker.max_message_bytes}; "
                "send smaller groups or raise that setting"))
        try:
            req = m.decode_request(payload)
        except m.ProtocolError as e:
            code = "invalid_group" if header and header[0] in m.PUSH_GROUP_TAGS else "bad_frame"
            self.state.rejected[code] += 1
            return ident, m.Error(req_id=req_id, code=code, reason=e.reason)
        start_ns = time.time_ns() if telemetry.enabled() else 0
        try:
            reply = self.state.handle(req, now)
        except Exception as e:  # noqa: BLE001 - a bug must not take the broker down; the request is answered
            log.exception("internal error on %s", type(req).__name__)
            self.state.rejected["internal"] += 1
            return ident, m.Error(req_id=req.req_id, code="internal", reason=f"{type(e).__name__}: {e}")
        if reply is None:  # a LeaseBatch that waits for groups
            self.waiting.append((ident, req, now + min(req.wait_s, MAX_WAIT_S)))  # type: ignore[arg-type]
        elif start_ns and isinstance(req, (m.PushGroup, m.PushGroups)):
            trace_ingest(req, reply, start_ns)
        return ident, reply

    def _serve_waiting(self, now: float, deadline_only: bool) -> list[tuple[bytes, m.Message]]:
        out, still = [], []
        for ident, req, deadline in self.waiting:
            if now >= deadline:
                out.append((ident, self.state.lease_batch_final(req, now)))
            elif not deadline_only and (reply := self.state.handle(req, now)) is not None:
                out.append((ident, reply))
            else:
                still.append((ident, req, deadline))
        self.waiting = still
        return out

    def _send(self, replies: list[tuple[bytes, m.Message]]) -> None:
        if self.state.spool is not None:
            self.state.spool.flush()  # records reach the OS before any ack leaves
        for ident, reply in replies:
            self.router.send([ident, m.encode(reply)])
            if isinstance(reply, m.BatchLease) and telemetry.enabled():
                trace_batch_lease(reply)
        for topic, ann in self.state.announcements:
            self.pub.send_multipart([topic, m.encode(ann)])
        self.state.announcements.clear()

    def _on_batch(self, batch: list[list[bytes]]) -> None:
        """Every frame that was ready: apply them all, write the spool once, then reply."""
        now = time.monotonic()
        replies, ingested = [], False
        for frames in batch:
            ident, reply = self._handle_frames(frames, now)
            ingested |= (isinstance(reply, m.Ack) and reply.count > 0) or isinstance(reply, m.GroupAcks)
            if reply is not None:
                replies.append((ident, reply))
        if ingested and self.waiting:
            replies.extend(self._serve_waiting(now, deadline_only=False))
        self._send(replies)

    async def serve(self) -> None:
        timer = asyncio.create_task(self._timers())
        try:
            await self._stop.wait()
        finally:
            timer.cancel()

    async def _timers(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.state.expire(now)
            replies = self._serve_waiting(now, deadline_only=False) if self.waiting else []
            spool = self.state.spool
            if spool is not None:
                spool.sync_if_due()
                if spool.needs_compaction():
                    spool.compact(self.state.snapshot())
            self._send(replies)

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
        if telemetry.sampled(g.trace):
            telemetry.record_span("broker.ingest", start_ns, end_ns, parent=g.trace, attributes={
                "fleetrl.group_id": g.group_id, "fleetrl.status": status, "fleetrl.client_id": req.client_id,
                "fleetrl.policy_version": g.policy_version})


def trace_batch_lease(reply: m.BatchLease) -> None:
    """A ``broker.batch_lease`` span (the moment the groups leave the queue) linked to each group's trace."""
    telemetry.record_span("broker.batch_lease", time.time_ns(), parent=telemetry.ROOT,
                          links=telemetry.group_links(reply.groups),
                          attributes={"fleetrl.lease_id": reply.lease_id, "fleetrl.groups": len(reply.groups),
                                      "fleetrl.dropped_stale": reply.dropped_stale})


def write_endpoint_file(run_dir: str | Path, server: BrokerServer) -> Path:
    """``broker.json`` in the run dir: where clients connect (also the launcher's ready signal)."""
    path = Path(run_dir) / "broker.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": server.address, "pub_address": server.pub_address, "pid": os.getpid(),
                               "broker_id": server.state.broker_id}))
    tmp.replace(path)
    return path


async def run_broker(cfg: JobConfig, run_dir: str | None) -> int:
    state = build_state(cfg)
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
        if run_dir:
            write_endpoint_file(run_dir, server)
        await server.serve()
        server.announce_shutdown()
    finally:
        server.close()
        server.ctx.term()
        log.info("broker stopped: %d groups in, %d out, %d still queued", state.counters["groups_in"],
                 state.counters["groups_out"], len(state.queued))
    return 0


def main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    run_dir = args.run_dir
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if not (Path(run_dir) / "config.yaml").exists():
            save_resolved(cfg, run_dir)
    setup_logging("broker", cfg.telemetry.log_level)
    telemetry.setup_tracing("broker", cfg.telemetry, run_dir, {"service.instance.id": "broker"})
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        return asyncio.run(run_broker(cfg, run_dir))
    return uvloop.run(run_broker(cfg, run_dir))
