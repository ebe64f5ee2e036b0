"""Client side of the broker protocol, used by rollout servers, learners and `fleetrl status`.

``AsyncBrokerClient`` (asyncio) owns one DEALER socket with many requests in flight, matched to
replies by ``req_id``. ``BrokerClient`` is the thin synchronous wrapper (its event loop runs in a
daemon thread, which also sends heartbeats while the caller computes). Both raise
``BrokerUnavailable`` when no reply comes in time — the message names the setting to raise — and
``BrokerError`` for a typed error reply. Every request is safe to retry: group pushes are
de-duplicated by ``group_id``, and leases lost with a reply expire and are re-issued.

``fleetrl.broker.inproc.InprocBrokerClient`` has the same methods without sockets (unit tests).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from fleetrl.broker.address import default_client_id, resolve_address
from fleetrl.broker.metrics import fleet_metrics, status_metrics
from fleetrl.broker.zio import LoopSocket
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig

# What other components use of the broker comes through this module (they import nothing else of it).
__all__ = ["AsyncBrokerClient", "BrokerClient", "BrokerError", "BrokerUnauthorized", "BrokerUnavailable",
           "Subscription", "default_client_id", "fleet_metrics", "resolve_address", "status_metrics"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class BrokerUnavailable(ConnectionError):
    """The broker did not answer in time (down, unreachable, or refusing this client)."""


class BrokerUnauthorized(BrokerUnavailable):
    """The broker refused this client's CURVE key."""


class BrokerError(RuntimeError):
    """A typed error reply; ``code`` is one of ``messages.ErrorCode``."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code, self.reason = code, reason


class AsyncBrokerClient:
    def __init__(self, address: str, client_id: str, role: str, rank: int = 0, *, timeout_s: float = 30.0,
                 curve: CurveConfig | None = None, info: dict[str, str] | None = None,
                 ctx: zmq.Context | None = None):
        self.address, self.client_id, self.role, self.rank = address, client_id, role, rank
        self.timeout_s, self.curve, self.info = timeout_s, curve, info or {}
        self.ctx = ctx or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.sock: LoopSocket | None = None
        self._monitor: LoopSocket | None = None
        self._auth_failed: asyncio.Future | None = None
        self.registered: m.Registered | None = None
        self.bad_replies = 0

    # ------------------------------------------------------------- lifecycle
    def _secure(self, sock: zmq.Socket) -> None:
        if not (self.curve.client_secret_key and self.curve.server_public_key):
            raise ValueError("broker.curve is set, so this client needs broker.curve.client_secret_key "
                             "(from `fleetrl keys generate`) and broker.curve.server_public_key")
        public, secret = zmq.auth.load_certificate(self.curve.client_secret_key)
        server_public, _ = zmq.auth.load_certificate(self.curve.server_public_key)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if self.curve is not None:
            self._secure(sock)
        return sock

    async def connect(self, timeout_s: float | None = None) -> m.Registered:
        """Connect and register (the ready handshake); raises BrokerUnavailable/Unauthorized."""
        try:
            raw = self._socket(zmq.DEALER)
            self.sock = LoopSocket(raw, self._on_replies)
            if self.curve is not None:
                self._auth_failed = asyncio.get_running_loop().create_future()
                monitor = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
                self._monitor = LoopSocket(monitor, self._on_monitor)
            raw.connect(self.address)
            register = self.request(lambda rid: m.Register(req_id=rid, client_id=self.client_id, role=self.role,
                                                           rank=self.rank, info=self.info),
                                    timeout_s=timeout_s or self.timeout_s, retries=0)
            reply = await (self._race_auth(register) if self._auth_failed is not None else register)
        except BaseException:
            await self.close()
            raise
        self.registered = reply
        return reply

    def _on_monitor(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            event = parse_monitor_message(frames)["event"]
            if event & (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                if self._auth_failed is not None and not self._auth_failed.done():
                    self._auth_failed.set_result(event)

    async def _race_auth(self, register: Awaitable[T]) -> T:
        task = asyncio.ensure_future(register)
        done, _ = await asyncio.wait({task, self._auth_failed}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise BrokerUnauthorized(f"the broker at {self.address} refused this client's CURVE key "
                                 f"({self.curve.client_secret_key}); add its public key to the broker's "
                                 "broker.curve.authorized_keys_dir")

    async def close(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrokerUnavailable("client closed"))
        self._pending.clear()
        if self.sock is not None:
            if self._monitor is not None:
                self.sock.sock.disable_monitor()
                self._monitor.close()
            self.sock.close()
        self.sock = self._monitor = None

    def _on_replies(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            try:
                reply = m.decode_reply(frames[-1])
            except m.ProtocolError as e:
                self.bad_replies += 1
                log.warning("ignored an undecodable reply from the broker: %s", e.reason)
                continue
            fut = self._pending.pop(reply.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    # --------------------------------------------------------------- requests
    async def request(self, make: Callable[[int], m.Message], *, timeout_s: float | None = None, retries: int = 2,
                      raise_errors: bool = True) -> Any:
        """Send ``make(req_id)``; wait for its reply, retrying with backoff on timeouts."""
        timeout = timeout_s or self.timeout_s
        for attempt in range(retries + 1):
            req_id = next(self._ids)
            fut = asyncio.get_running_loop().create_future()
            self._pending[req_id] = fut
            self.sock.send([m.encode(make(req_id))])
            try:
                reply = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                self._pending.pop(req_id, None)
                if attempt < retries:
                    await asyncio.sleep(min(5.0, 0.2 * 2**attempt) * (0.5 + random.random()))
                continue
            if raise_errors and isinstance(reply, m.Error):
                raise BrokerError(reply.code, reply.reason)
            return reply
        raise BrokerUnavailable(
            f"no reply from the broker at {self.address} within {timeout:g} s ({retries + 1} attempt(s)); check that it "
            "runs and that broker.address (or --broker) points to it, or raise broker.request_timeout_s")

    async def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle:
        return await self.request(lambda r: m.LeasePrompts(req_id=r, client_id=self.client_id, n=n, policy_version=policy_version))

    async def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack:
        """Push until acknowledged (the broker de-duplicates retries); BrokerError for an invalid group."""
        limit = self.registered.max_message_bytes if self.registered else 0
        frame = m.encode(m.PushGroup(req_id=0, client_id=self.client_id, group=group))
        if limit and len(frame) > limit:
            raise BrokerError("too_large", f"group {group.group_id} is {len(frame)} bytes, over "
                                           f"broker.max_message_bytes={limit}; generate shorter responses or raise that setting")
        give_up = time.monotonic() + deadline_s
        while True:
            try:
                return await self.request(lambda r: m.PushGroup(req_id=r, client_id=self.client_id, group=group))
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                log.warning("broker did not ack group %s; retrying", group.group_id)

    async def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]:
        """Push several groups in one frame until acknowledged; one GroupAck per group, in order."""
        limit = self.registered.max_message_bytes if self.registered else 0
        frame = m.encode(m.PushGroups(req_id=0, client_id=self.client_id, groups=groups))
        if limit and len(frame) > limit:
            if len(groups) == 1:
                raise BrokerError("too_large", f"group {groups[0].group_id} is {len(frame)} bytes, over "
                                               f"broker.max_message_bytes={limit}; generate shorter responses or raise it")
            half = len(groups) // 2
            return await self.push_groups(groups[:half], deadline_s) + await self.push_groups(groups[half:], deadline_s)
        give_up = time.monotonic() + deadline_s
        while True:
            try:
                reply = await self.request(lambda r: m.PushGroups(req_id=r, client_id=self.client_id, groups=groups))
                return reply.acks
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                log.warning("broker did not ack %d groups; retrying", len(groups))

    async def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack:
        return await self.request(lambda r: m.ReturnPrompts(req_id=r, client_id=self.client_id, lease_id=lease_id,
                                                            prompt_ids=list(prompt_ids or []), unscored=unscored))

    async def leave(self, reason: str = "", done: bool = False, timeout_s: float = 5.0) -> m.Ack:
        """Leave the fleet now (graceful exit); ``done``: a learner that finished. One short try: a client on its
        way out does not wait long for a broker that is gone (it is then dropped after client_timeout_s)."""
        return await self.request(lambda r: m.Leave(req_id=r, client_id=self.client_id, reason=reason, done=done),
                                  timeout_s=timeout_s, retries=0)

    async def lease_batch(self, n: int, wait_s: float = 0.0, min_groups: int = 1) -> m.BatchLease | m.Throttle:
        return await self.request(
            lambda r: m.LeaseBatch(req_id=r, client_id=self.client_id, n=n, wait_s=wait_s, min_groups=min_groups),
            timeout_s=self.timeout_s + wait_s)

    async def ack_batch(self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False) -> m.Ack:
        return await self.request(lambda r: m.AckBatch(req_id=r, client_id=self.client_id, lease_id=lease_id, step=step,
                                                       group_ids=list(group_ids), keep_rest=keep_rest))

    async def commit(self, step: int) -> m.Ack:
        return await self.request(lambda r: m.Commit(req_id=r, client_id=self.client_id, step=step))

    async def rewind(self, step: int) -> m.Ack:
        return await self.request(lambda r: m.Rewind(req_id=r, client_id=self.client_id, step=step))

    async def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return await self.request(lambda r: m.PublishVersion(req_id=r, client_id=self.client_id, version=version,
                                                             step=step, weights=weights))

    async def control(self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1) -> m.Ack:
        return await self.request(lambda r: m.Control(req_id=r, client_id=self.client_id, action=action, reason=reason,
                                                      min_version=min_version, max_version=max_version))

    async def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack:
        return await self.request(lambda r: m.Heartbeat(req_id=r, client_id=self.client_id, policy_version=policy_version,
                                                        stats=stats or {}), retries=0)

    async def current_version(self) -> m.CurrentVersion:
        return await self.request(lambda r: m.GetVersion(req_id=r, client_id=self.client_id))

    async def status(self) -> m.Status:
        return await self.request(lambda r: m.GetStatus(req_id=r, client_id=self.client_id))

    def pub_address(self) -> str | None:
        """The broker's announcement endpoint (same host as the request endpoint)."""
        if self.registered is None or not self.registered.pub_port:
            return None
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.registered.pub_port}"

    def subscribe(self) -> "AsyncSubscription":
        address = self.pub_address()
        if address is None:
            raise BrokerUnavailable("the broker announced no PUB port; connect() first")
        sock = self._socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        return AsyncSubscription(sock)


class AsyncSubscription:
    """Version and control announcements from the broker's PUB socket."""

    def __init__(self, sock: zmq.Socket):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.bad = 0
        self.sock = LoopSocket(sock, self._on_batch)

    def _on_batch(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            try:
                self.queue.put_nowait(m.decode_announcement(frames[-1]))
            except m.ProtocolError:
                self.bad += 1

    async def next(self, timeout_s: float | None = None) -> m.Announcement | None:
        """The next announcement, or None after ``timeout_s`` (0 = only what is already there)."""
        if timeout_s is not None and timeout_s <= 0:
            return None if self.queue.empty() else self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        self.sock.close()


class BrokerClient:
    """Synchronous wrapper: the async client runs on an event loop in a daemon thread."""

    def __init__(self, address: str, client_id: str, role: str, rank: int = 0, *, timeout_s: float = 30.0,
                 curve: CurveConfig | None = None, info: dict[str, str] | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"broker-client-{client_id}", daemon=True)
        self._thread.start()
        self._ctx = zmq.Context()
        self.client = AsyncBrokerClient(address, client_id, role, rank, timeout_s=timeout_s, curve=curve, info=info,
                                        ctx=self._ctx)
        self._heartbeat: asyncio.Future | None = None
        self._subs: list[AsyncSubscription] = []

    @property
    def client_id(self) -> str:
        return self.client.client_id

    @property
    def registered(self) -> m.Registered | None:
        return self.client.registered

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def connect(self, timeout_s: float | None = None) -> m.Registered:
        try:
            return self._run(self.client.connect(timeout_s))
        except BaseException:
            self.close()
            raise

    def start_heartbeat(self, stats: Callable[[], tuple[int, dict[str, float]]], interval_s: float) -> None:
        """Heartbeat every ``interval_s`` with ``stats() -> (policy_version, stats)`` from this thread."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    version, values = stats()
                    await self.client.heartbeat(version, values)
                except (BrokerUnavailable, BrokerError) as e:
                    log.debug("heartbeat failed: %s", e)

        self._heartbeat = asyncio.run_coroutine_threadsafe(beat(), self._loop)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(method(*args, **kwargs))

        return call

    def subscribe(self) -> "Subscription":
        sub = self._run(self._subscribe())
        self._subs.append(sub)
        return Subscription(self, sub)

    async def _subscribe(self) -> AsyncSubscription:
        return self.client.subscribe()  # LoopSocket needs the client's loop

    def close(self) -> None:
        if not self._loop.is_running():
            return
        if self._heartbeat is not None:
            self._heartbeat.cancel()

        async def shutdown() -> None:
            for sub in self._subs:
                sub.close()
            await self.client.close()

        try:
            self._run(shutdown(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._ctx.term()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscription:
    def __init__(self, owner: BrokerClient, sub: AsyncSubscription):
        self._owner, self._sub = owner, sub

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None:
        return self._owner._run(self._sub.next(timeout_s))

    def drain(self) -> list[m.Announcement]:
        out = []
        while (ann := self.next(0)) is not None:
            out.append(ann)
        return out
