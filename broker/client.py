"""How other components reach the broker: the :class:`BrokerClient` protocol and its implementations.

- :class:`BrokerClient` (a ``typing.Protocol``) is the synchronous interface rollout servers and
  learners are written against; ``ZmqBrokerClient`` here (sockets) and
  ``fleetrl.broker.inproc.InprocBrokerClient`` (the in-process twin of unit tests) both satisfy it
  (``tests/broker/test_client_protocol.py`` checks).
- ``ZmqBrokerClient`` wraps ``AsyncBrokerClient`` (``aclient.py``): its event loop runs in a daemon
  thread, which also sends heartbeats while the caller computes. Both raise ``BrokerUnavailable``
  when no reply comes in time — the message names the setting to raise — and ``BrokerError`` for a
  typed error reply.

Other components import nothing else of the broker: this module re-exports the address and
status-metrics helpers they need.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable, Protocol, TypeVar, runtime_checkable

import zmq

from fleetrl.broker.aclient import AsyncBrokerClient, AsyncSubscription, BrokerError, BrokerUnauthorized, BrokerUnavailable
from fleetrl.broker.address import client_identity, default_client_id, resolve_address
from fleetrl.broker.metrics import expected_receivers, fleet_metrics, status_metrics
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig

__all__ = ["AsyncBrokerClient", "BrokerClient", "BrokerError", "BrokerUnauthorized", "BrokerUnavailable",
           "Subscription", "SubscriptionLike", "ZmqBrokerClient", "client_identity", "default_client_id",
           "expected_receivers", "fleet_metrics", "resolve_address", "status_metrics"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@runtime_checkable
class SubscriptionLike(Protocol):
    """Announcements (version, control) as they arrive."""

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None: ...

    def drain(self) -> list[m.Announcement]: ...


@runtime_checkable
class BrokerClient(Protocol):
    """The synchronous broker client every component is written against (docs/broker.md#messages)."""

    client_id: str

    @property
    def registered(self) -> m.Registered | None: ...

    def connect(self, timeout_s: float | None = None) -> m.Registered: ...

    def start_heartbeat(self, stats: Callable[[], tuple[int, dict[str, float]]], interval_s: float) -> None: ...

    def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle: ...

    def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack: ...

    def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]: ...

    def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack: ...

    def leave(self, reason: str = "", done: bool = False) -> m.Ack: ...

    def lease_batch(self, n: int, wait_s: float = 0.0, min_groups: int = 1) -> m.BatchLease | m.Throttle: ...

    def ack_batch(self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False) -> m.Ack: ...

    def commit(self, step: int) -> m.Ack: ...

    def rewind(self, step: int) -> m.Ack: ...

    def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack: ...

    def control(self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1,
                target: str = "") -> m.Ack: ...

    def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack: ...

    def current_version(self) -> m.CurrentVersion: ...

    def status(self) -> m.Status: ...

    def subscribe(self) -> SubscriptionLike: ...

    def close(self) -> None: ...


class ZmqBrokerClient:
    """:class:`BrokerClient` over ZeroMQ: the async client runs on an event loop in a daemon thread."""

    def __init__(self, address: str, client_id: str, role: str, rank: int = 0, *, timeout_s: float = 30.0,
                 curve: CurveConfig | None = None, info: dict[str, str] | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"broker-client-{client_id}", daemon=True)
        self._thread.start()
        self._ctx = zmq.Context()
        self.client = AsyncBrokerClient(address, client_id, role, rank, timeout_s=timeout_s, curve=curve, info=info,
                                        ctx=self._ctx)
        self.client_id = client_id
        self._heartbeat: asyncio.Future | None = None
        self._subs: list[AsyncSubscription] = []

    @property
    def registered(self) -> m.Registered | None:
        return self.client.registered

    @property
    def address(self) -> str:
        return self.client.address

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
        return self._run(self.client.leave(reason, done))

    def lease_batch(self, n: int, wait_s: float = 0.0, min_groups: int = 1) -> m.BatchLease | m.Throttle:
        return self._run(self.client.lease_batch(n, wait_s, min_groups))

    def ack_batch(self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False) -> m.Ack:
        return self._run(self.client.ack_batch(lease_id, group_ids, step, keep_rest))

    def commit(self, step: int) -> m.Ack:
        return self._run(self.client.commit(step))

    def rewind(self, step: int) -> m.Ack:
        return self._run(self.client.rewind(step))

    def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return self._run(self.client.publish_version(version, step, weights))

    def control(self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1,
                target: str = "") -> m.Ack:
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

    def __enter__(self) -> "ZmqBrokerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscription:
    def __init__(self, owner: ZmqBrokerClient, sub: AsyncSubscription):
        self._owner, self._sub = owner, sub

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None:
        return self._owner._run(self._sub.next(timeout_s))

    def drain(self) -> list[m.Announcement]:
        out = []
        while (ann := self.next(0)) is not None:
            out.append(ann)
        return out
