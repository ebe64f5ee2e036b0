"""The asyncio client of the broker protocol (``AsyncBrokerClient``) and its announcement subscription.

One DEALER socket with many requests in flight, matched to replies by ``req_id``. Every request is
safe to retry: group pushes are de-duplicated by ``group_id``, leases lost with a reply expire and are
re-issued. The client retries by itself what the broker asks it to: a timeout (with backoff), an
``unavailable`` error (a full spool disk: nothing changed, retry later), an ``unregistered`` error
(the broker restarted or evicted this client: register again, then retry), and pushes that were
throttled. Other components use it through ``broker/client/sync.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, cast

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from fleetrl.broker.client.errors import BrokerError, BrokerUnauthorized, BrokerUnavailable
from fleetrl.broker.zio import LoopSocket
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig

log = logging.getLogger("fleetrl.broker.client.sync")
T = TypeVar("T")
ControlAction = Literal["pause", "resume", "stop", "discard", "quarantine", "release"]
HEARTBEAT_MS = 5000  # ZMTP heartbeats: a half-open connection to a vanished broker is noticed and redialled
RETRY_LATER = ("unavailable",)


class AsyncBrokerClient:
    def __init__(
        self,
        address: str,
        client_id: str,
        role: str,
        rank: int = 0,
        *,
        timeout_s: float = 30.0,
        curve: CurveConfig | None = None,
        info: dict[str, str] | None = None,
        ctx: zmq.Context | None = None,
    ):
        self.address, self.client_id, self.role, self.rank = address, client_id, role, rank
        self.timeout_s, self.curve, self.info = timeout_s, curve, info or {}
        self.ctx = ctx or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.sock: LoopSocket | None = None
        self._monitor: LoopSocket | None = None
        self._auth_failed: asyncio.Future | None = None
        self._handshake = {"connected": False, "succeeded": False}  # what the CURVE socket monitor saw
        self.registered: m.Registered | None = None
        self.bad_replies = 0
        self.reregistered = 0
        self.left = False  # leave() was sent: a later request's "unregistered" is the truth, not a broker that forgot

    # ------------------------------------------------------------- lifecycle
    def _secure(self, sock: zmq.Socket) -> None:
        curve = self.curve
        if curve is None or not (curve.client_secret_key and curve.server_public_key):
            raise ValueError(
                "broker.curve is set, so this client needs broker.curve.client_secret_key "
                "(from `fleetrl keys generate`) and broker.curve.server_public_key"
            )
        from fleetrl.broker.security.auth import check_secret_file

        check_secret_file(curve.client_secret_key, "broker.curve.client_secret_key")
        public, secret = zmq.auth.load_certificate(curve.client_secret_key)
        server_public, _ = zmq.auth.load_certificate(curve.server_public_key)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        if self.curve is not None:
            self._secure(sock)
        return sock

    def _register_request(self, rid: int) -> m.Register:
        return m.Register(
            req_id=rid, client_id=self.client_id, role=cast(m.Role, self.role), rank=self.rank, info=self.info
        )

    async def connect(self, timeout_s: float | None = None) -> m.Registered:
        """Connect and register (the ready handshake); raises BrokerUnavailable/Unauthorized/BrokerError."""
        try:
            raw = self._socket(zmq.DEALER)
            self.sock = LoopSocket(raw, self._on_replies)
            if self.curve is not None:
                self._auth_failed = asyncio.get_running_loop().create_future()
                monitor = raw.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_CONNECTED
                    | zmq.EVENT_HANDSHAKE_SUCCEEDED
                )
                self._monitor = LoopSocket(monitor, self._on_monitor)
            raw.connect(self.address)
            register = self.request(
                self._register_request, timeout_s=timeout_s or self.timeout_s, retries=0, reregister=False
            )
            reply = await (self._race_auth(register) if self._auth_failed is not None else register)
        except BaseException:
            await self.close()
            raise
        self.registered, self.left = reply, False
        return reply

    def _on_monitor(self, batch: list[list[bytes]]) -> None:
        for frames in batch:
            event = parse_monitor_message(frames)["event"]
            self._handshake["connected"] |= event == zmq.EVENT_CONNECTED
            self._handshake["succeeded"] |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            if event & (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                if self._auth_failed is not None and not self._auth_failed.done():
                    self._auth_failed.set_result(event)

    async def _race_auth(self, register: Awaitable[T]) -> T:
        """The Register's reply, or BrokerUnauthorized as soon as the broker refuses the key (or, at the
        Register's timeout, when the broker took the connection but no CURVE handshake ever succeeded: a
        wrong broker.curve.server_public_key is never answered)."""
        task = asyncio.ensure_future(register)
        done, _ = await asyncio.wait(
            {task, cast("asyncio.Future[Any]", self._auth_failed)}, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            try:
                return task.result()
            except BrokerUnavailable:
                if self.curve is None or not (self._handshake["connected"] and not self._handshake["succeeded"]):
                    raise
                raise BrokerUnauthorized(
                    f"the broker at {self.address} took the connection but no CURVE handshake succeeded: check "
                    f"broker.curve.server_public_key ({self.curve.server_public_key}) and that this client's key "
                    f"({self.curve.client_secret_key}) is in the broker's broker.curve.authorized_keys_dir"
                ) from None
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its 'client closed' is expected
        raise BrokerUnauthorized(
            f"the broker at {self.address} refused this client's CURVE key "
            f"({self.curve.client_secret_key if self.curve else ''}); add its public key to the broker's "
            "broker.curve.authorized_keys_dir/<role>/"
        )

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
    async def _once(self, make: Callable[[int], m.Message], timeout: float) -> Any:
        """One attempt: the reply, or None on a timeout."""
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        cast(LoopSocket, self.sock).send([m.encode(make(req_id))])  # connected before any request
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(req_id, None)
            return None

    async def request(
        self,
        make: Callable[[int], m.Message],
        *,
        timeout_s: float | None = None,
        retries: int = 2,
        raise_errors: bool = True,
        reregister: bool = True,
        retry_later: bool = True,
    ) -> Any:
        """Send ``make(req_id)``; wait for its reply, retrying with backoff on timeouts and (``retry_later``)
        ``unavailable``, registering again once on ``unregistered`` (``reregister``)."""
        timeout = timeout_s or self.timeout_s
        attempts, busy = retries + 1, 0
        while attempts > 0:
            reply = await self._once(make, timeout)
            if isinstance(reply, m.Error) and reply.code == "unregistered" and reregister and not self.left:
                reregister = False
                await self._reregister()
                continue
            if isinstance(reply, m.Error) and reply.code in RETRY_LATER and retry_later and busy < max(4, retries):
                busy += 1
                log.warning("broker busy (%s); retrying in %.1f s", reply.reason, min(5.0, 0.5 * 2**busy))
                await asyncio.sleep(min(5.0, 0.5 * 2**busy))
                continue
            if reply is None:
                attempts -= 1
                if attempts:
                    await asyncio.sleep(min(5.0, 0.2 * 2 ** (retries - attempts)) * (0.5 + random.random()))
                continue
            if raise_errors and isinstance(reply, m.Error):
                raise BrokerError(reply.code, reply.reason)
            return reply
        raise BrokerUnavailable(
            f"no reply from the broker at {self.address} within {timeout:g} s ({retries + 1} attempt(s)); check that it "
            "runs and that broker.address (or --broker) points to it, or raise broker.request_timeout_s"
        )

    async def _reregister(self) -> None:
        log.info("the broker forgot client %s (it restarted or evicted it); registering again", self.client_id)
        self.registered = await self.request(self._register_request, reregister=False)
        self.reregistered += 1

    async def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle:
        return await self.request(
            lambda r: m.LeasePrompts(req_id=r, client_id=self.client_id, n=n, policy_version=policy_version)
        )

    def _limits(self) -> tuple[int, int]:
        reg = self.registered
        return (reg.max_message_bytes, reg.max_groups_per_push) if reg else (0, 0)

    async def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack:
        """Push until acknowledged (the broker de-duplicates retries); BrokerError for an invalid group."""
        limit, _ = self._limits()
        body = m.encode_raw(group)  # encoded once: the size check and every attempt reuse it
        group_bytes = cast(m.SampleGroup, body)  # the group's encoded bytes (msgspec.Raw), sent as they are
        frame_len = len(m.encode(m.PushGroup(req_id=0, client_id=self.client_id, group=group_bytes)))
        if limit and frame_len > limit:
            raise BrokerError(
                "too_large",
                f"group {group.group_id} is {frame_len} bytes, over "
                f"broker.max_message_bytes={limit}; generate shorter responses or raise that setting",
            )
        give_up = time.monotonic() + deadline_s
        while True:
            try:
                reply = await self.request(lambda r: m.PushGroup(req_id=r, client_id=self.client_id, group=group_bytes))
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                log.warning("broker did not ack group %s; retrying", group.group_id)
                continue
            if not isinstance(reply, m.Throttle):
                return reply
            if time.monotonic() > give_up:
                raise BrokerUnavailable(f"the broker kept throttling group {group.group_id}: {reply.reason}")
            await asyncio.sleep(min(5.0, max(0.05, reply.retry_after_s)))

    async def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]:
        """Push several groups in one frame until acknowledged; one GroupAck per group, in order (never
        ``throttled``: those are pushed again until taken or ``deadline_s`` passes)."""
        limit, most = self._limits()
        if most and len(groups) > most:
            return await self.push_groups(groups[:most], deadline_s) + await self.push_groups(groups[most:], deadline_s)
        bodies = [m.encode_raw(g) for g in groups]  # each group encoded once: size check, send and retries reuse it
        frame_len = len(m.encode(m.PushGroups(req_id=0, client_id=self.client_id, groups=[])))
        n = len(bodies)  # msgpack's array header: 1 byte (empty, as above), 1 / 3 / 5 bytes for n groups
        frame_len += sum(len(b) for b in bodies) + (0 if n < 16 else 2 if n < 65536 else 4)
        if limit and frame_len > limit:
            if len(groups) == 1:
                raise BrokerError(
                    "too_large",
                    f"group {groups[0].group_id} is {frame_len} bytes, over "
                    f"broker.max_message_bytes={limit}; generate shorter responses or raise it",
                )
            half = len(groups) // 2
            return await self.push_groups(groups[:half], deadline_s) + await self.push_groups(groups[half:], deadline_s)
        give_up = time.monotonic() + deadline_s
        acks: dict[str, m.GroupAck] = {}
        todo = list(groups)
        encoded = {g.group_id: b for g, b in zip(groups, bodies)}
        while todo:
            body = [cast(m.SampleGroup, encoded[g.group_id]) for g in todo]  # a retry re-sends the same bytes
            try:
                reply = await self.request(lambda r: m.PushGroups(req_id=r, client_id=self.client_id, groups=body))
            except BrokerUnavailable:
                if time.monotonic() > give_up:
                    raise
                log.warning("broker did not ack %d groups; retrying", len(todo))
                continue
            acks.update((a.group_id, a) for a in reply.acks if a.status != "throttled")
            todo = [g for g in todo if g.group_id not in acks]
            if todo:
                if time.monotonic() > give_up:
                    raise BrokerUnavailable(f"the broker kept throttling {len(todo)} groups: {reply.acks[0].reason}")
                await asyncio.sleep(1.0)
        return [acks[g.group_id] for g in groups]

    async def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack:
        return await self.request(
            lambda r: m.ReturnPrompts(
                req_id=r,
                client_id=self.client_id,
                lease_id=lease_id,
                prompt_ids=list(prompt_ids or []),
                unscored=unscored,
            )
        )

    async def leave(self, reason: str = "", done: bool = False, timeout_s: float = 5.0) -> m.Ack:
        """Leave the fleet now (graceful exit); ``done``: a learner that finished. One short try: a client on its
        way out does not wait long for a broker that is gone (it is then dropped after client_timeout_s). From
        then on no request registers this client again, so a heartbeat racing the stop cannot put a server that
        left back into the fleet (where weight rounds would wait for it until broker.client_timeout_s)."""
        self.left = True
        return await self.request(
            lambda r: m.Leave(req_id=r, client_id=self.client_id, reason=reason, done=done),
            timeout_s=timeout_s,
            retries=0,
        )

    async def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle:
        return await self.request(
            lambda r: m.LeaseBatch(
                req_id=r, client_id=self.client_id, n=n, wait_s=wait_s, min_groups=min_groups, for_version=for_version
            ),
            timeout_s=self.timeout_s + wait_s,
        )

    async def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack:
        return await self.request(
            lambda r: m.AckBatch(
                req_id=r,
                client_id=self.client_id,
                lease_id=lease_id,
                step=step,
                group_ids=list(group_ids),
                keep_rest=keep_rest,
                give_back=give_back,
            )
        )

    async def commit(self, step: int) -> m.Ack:
        return await self.request(lambda r: m.Commit(req_id=r, client_id=self.client_id, step=step))

    async def rewind(self, step: int) -> m.Ack:
        return await self.request(lambda r: m.Rewind(req_id=r, client_id=self.client_id, step=step))

    async def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return await self.request(
            lambda r: m.PublishVersion(req_id=r, client_id=self.client_id, version=version, step=step, weights=weights)
        )

    async def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack:
        return await self.request(
            lambda r: m.Control(  # the broker refuses an unknown action (a typed error)
                req_id=r,
                client_id=self.client_id,
                action=cast(ControlAction, action),
                reason=reason,
                min_version=min_version,
                max_version=max_version,
                target=target,
            )
        )

    async def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack:
        return await self.request(
            lambda r: m.Heartbeat(req_id=r, client_id=self.client_id, policy_version=policy_version, stats=stats or {}),
            retries=0,
        )

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

    def subscribe(self) -> AsyncSubscription:
        address = self.pub_address()
        if address is None:
            raise BrokerUnavailable("the broker announced no PUB port; connect() first")
        sock = self._socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        return AsyncSubscription(sock)


WAKE = object()  # put on a subscription's queue by `wake`: ends a wait in `next` without an announcement


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
            got = None if self.queue.empty() else self.queue.get_nowait()
        else:
            try:
                got = await asyncio.wait_for(self.queue.get(), timeout_s)
            except asyncio.TimeoutError:
                return None
        return None if got is WAKE else got

    def wake(self) -> None:
        """(this loop's thread) End a wait in `next` now: it returns None."""
        self.queue.put_nowait(WAKE)

    async def drain(self) -> list[m.Announcement]:
        """Every announcement already queued (none waited for)."""
        out = []
        while not self.queue.empty():
            got = self.queue.get_nowait()
            if got is not WAKE:
                out.append(got)
        return out

    def close(self) -> None:
        self.sock.close()
