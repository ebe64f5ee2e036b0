"""``ZmqBrokerClient``: the synchronous broker client over ZeroMQ, for every role (``roles.py``).

It wraps ``AsyncBrokerClient`` (``aio.py``): that client's event loop runs in a daemon thread, which also
sends heartbeats while the caller computes. Both raise ``BrokerUnavailable`` when no reply comes in time
— the message names the setting to raise — and ``BrokerError`` for a typed error reply (``errors.py``).
The in-process twin with the same methods is ``inproc.py``'s ``InprocBrokerClient``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zmq

from fleetrl.broker.client.aio import AsyncBrokerClient, AsyncSubscription
from fleetrl.broker.client.errors import BrokerError, BrokerUnavailable
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class ZmqBrokerClient:
    """Every role's calls (``roles.py``) over ZeroMQ: the async client runs on an event loop in a daemon thread
    of its own, or on ``loop``, an event loop that already runs in another thread (a rollout server's engine
    loop: one loop then carries the engine's and the broker's traffic). The synchronous methods must not be
    called from that loop's own thread (they wait for it)."""

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
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self._own_loop = loop is None
        self._loop = loop or asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        if self._own_loop:
            self._thread = threading.Thread(
                target=self._loop.run_forever, name=f"broker-client-{client_id}", daemon=True
            )
            self._thread.start()
        self._ctx = zmq.Context()
        self.client = AsyncBrokerClient(
            address, client_id, role, rank, timeout_s=timeout_s, curve=curve, info=info, ctx=self._ctx
        )
        self.client_id = client_id
        self._heartbeat: concurrent.futures.Future[None] | None = None
        self._subs: list[AsyncSubscription] = []

    @property
    def registered(self) -> m.Registered | None:
        return self.client.registered

    @property
    def address(self) -> str:
        return self.client.address

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
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

    # ------------------------------------------------------------------ requests (see AsyncBrokerClient)
    def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle:
        return self._run(self.client.lease_prompts(n, policy_version))

    def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack:
        return self._run(self.client.push_group(group, deadline_s))

    def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]:
        return self._run(self.client.push_groups(groups, deadline_s))

    def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack:
        return self._run(self.client.return_prompts(lease_id, prompt_ids, unscored))

    def leave(self, reason: str = "", done: bool = False) -> m.Ack:
        if self._heartbeat is not None:  # a client that left sends nothing more on its own
            self._heartbeat.cancel()
        return self._run(self.client.leave(reason, done))

    def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle:
        return self._run(self.client.lease_batch(n, wait_s, min_groups, for_version))

    def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack:
        return self._run(self.client.ack_batch(lease_id, group_ids, step, keep_rest, give_back))

    def commit(self, step: int) -> m.Ack:
        return self._run(self.client.commit(step))

    def rewind(self, step: int) -> m.Ack:
        return self._run(self.client.rewind(step))

    def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return self._run(self.client.publish_version(version, step, weights))

    def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack:
        return self._run(self.client.control(action, reason, min_version, max_version, target))

    def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack:
        return self._run(self.client.heartbeat(policy_version, stats))

    def current_version(self) -> m.CurrentVersion:
        return self._run(self.client.current_version())

    def status(self) -> m.Status:
        return self._run(self.client.status())

    def request(self, make: Callable[[int], m.Message], **kw: Any) -> Any:
        """A raw request (tests and tools): ``make(req_id)`` -> the reply (see AsyncBrokerClient.request)."""
        return self._run(self.client.request(make, **kw))

    def subscribe(self) -> Subscription:
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
            if self._thread is not None:  # the loop is ours (a given loop belongs to its owner)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
            self._ctx.term()

    def __enter__(self) -> ZmqBrokerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscription:
    def __init__(self, owner: ZmqBrokerClient, sub: AsyncSubscription):
        self._owner, self._sub = owner, sub

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None:
        return self._owner._run(self._sub.next(timeout_s))

    def wake(self) -> None:
        """(any thread) End a wait in `next` now, without an announcement: it returns None."""
        self._owner._loop.call_soon_threadsafe(self._sub.wake)

    def drain(self) -> list[m.Announcement]:
        """Every announcement already there, in one visit to the client's loop (none when its queue is empty)."""
        if self._sub.queue.empty():  # read across threads: one that lands meanwhile is taken by the next call
            return []
        return self._owner._run(self._sub.drain())
