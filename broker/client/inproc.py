"""In-process twin of the socket client: a :class:`~fleetrl.broker.client.roles.BrokerClient` without sockets.

Several twins may share one :class:`InprocBroker` (one per simulated rollout server or learner rank),
from several threads. Unit tests of the rollout server and the learner run on it. Each twin acts with
the role it was created with (as if its key had that role), so the permission table applies here too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from fleetrl.broker.client.aio import ControlAction
from fleetrl.broker.client.errors import BrokerError
from fleetrl.broker.security.auth import Principal
from fleetrl.broker.server.state import BrokerState
from fleetrl.common import messages as m


class InprocBroker:
    """A BrokerState behind a lock, with announcement queues for subscribers."""

    def __init__(self, state: BrokerState, clock: Callable[[], float] = time.monotonic):
        self.state, self.clock = state, clock
        self.lock = threading.Condition()
        self.subscribers: list[deque] = []
        self._ids = 0

    def handle(
        self, req_factory: Callable[[int], m.Request], wait_s: float = 0.0, principal: Principal | None = None
    ) -> m.Message:
        deadline = self.clock() + wait_s
        with self.lock:
            self._ids += 1
            req = req_factory(self._ids)
            while True:
                now = self.clock()
                self.state.expire(now)
                reply = self.state.handle(req, now, principal)
                if reply is None and now >= deadline:
                    reply = self.state.lease_batch_final(req, now)  # type: ignore[arg-type]
                if reply is not None:
                    break
                self.lock.wait(timeout=min(0.05, max(0.0, deadline - now)))
            if (isinstance(reply, m.Ack) and reply.count) or isinstance(reply, m.GroupAcks):
                self.lock.notify_all()
            for _, ann in self.state.announcements:
                for q in self.subscribers:
                    q.append(ann)
            self.state.announcements.clear()
            if self.state.spool is not None:
                self.state.spool.flush()
        return reply

    def client(self, client_id: str, role: str, rank: int = 0) -> InprocBrokerClient:
        return InprocBrokerClient(self, client_id, role, rank)


class InprocSubscription:
    def __init__(self, queue: deque):
        self.queue = queue
        self._woken = threading.Event()

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None:
        deadline = time.monotonic() + timeout_s
        while not self.queue and time.monotonic() < deadline and not self._woken.is_set():
            self._woken.wait(min(0.01, max(0.0, deadline - time.monotonic())))
        self._woken.clear()
        return self.queue.popleft() if self.queue else None

    def wake(self) -> None:
        """(any thread) End a wait in `next` now."""
        self._woken.set()

    def drain(self) -> list[m.Announcement]:
        out = []
        while self.queue:
            out.append(self.queue.popleft())
        return out


class InprocBrokerClient:
    """The synchronous BrokerClient interface over an InprocBroker."""

    def __init__(self, broker: InprocBroker, client_id: str, role: str, rank: int = 0):
        self.broker, self.client_id, self.role, self.rank = broker, client_id, role, rank
        self.registered: m.Registered | None = None
        self.principal = Principal(client_id, role)

    def _call(self, make: Callable[[int], m.Request], wait_s: float = 0.0) -> Any:
        reply = self.broker.handle(make, wait_s, self.principal)
        if isinstance(reply, m.Error) and reply.code == "unregistered" and not isinstance(make(0), m.Register):
            self.connect()  # not registered (or evicted): register, then retry, like the socket client
            reply = self.broker.handle(make, wait_s, self.principal)
        if isinstance(reply, m.Error):
            raise BrokerError(reply.code, reply.reason)
        return reply

    def connect(self, timeout_s: float | None = None) -> m.Registered:
        self.registered = self._call(
            lambda r: m.Register(req_id=r, client_id=self.client_id, role=cast(m.Role, self.role), rank=self.rank)
        )
        return self.registered

    def start_heartbeat(self, stats: Callable[[], tuple[int, dict[str, float]]], interval_s: float) -> None:
        pass  # every call already refreshes liveness in-process

    def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle:
        return self._call(
            lambda r: m.LeasePrompts(req_id=r, client_id=self.client_id, n=n, policy_version=policy_version)
        )

    def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack:
        while isinstance(
            reply := self._call(lambda r: m.PushGroup(req_id=r, client_id=self.client_id, group=group)), m.Throttle
        ):
            time.sleep(min(1.0, reply.retry_after_s))  # like the socket client: a throttled push is pushed again
        return reply

    def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]:
        acks: dict[str, m.GroupAck] = {}
        todo = list(groups)
        while todo:  # throttled groups are pushed again, like the socket client does
            reply = self._call(lambda r: m.PushGroups(req_id=r, client_id=self.client_id, groups=todo))
            acks.update((a.group_id, a) for a in reply.acks if a.status != "throttled")
            todo = [g for g in todo if g.group_id not in acks]
            if todo:
                time.sleep(0.2)
        return [acks[g.group_id] for g in groups]

    def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack:
        return self._call(
            lambda r: m.ReturnPrompts(
                req_id=r,
                client_id=self.client_id,
                lease_id=lease_id,
                prompt_ids=list(prompt_ids or []),
                unscored=unscored,
            )
        )

    def leave(self, reason: str = "", done: bool = False) -> m.Ack:
        return self._call(lambda r: m.Leave(req_id=r, client_id=self.client_id, reason=reason, done=done))

    def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle:
        return self._call(
            lambda r: m.LeaseBatch(
                req_id=r, client_id=self.client_id, n=n, wait_s=wait_s, min_groups=min_groups, for_version=for_version
            ),
            wait_s,
        )

    def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack:
        return self._call(
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

    def commit(self, step: int) -> m.Ack:
        return self._call(lambda r: m.Commit(req_id=r, client_id=self.client_id, step=step))

    def rewind(self, step: int) -> m.Ack:
        return self._call(lambda r: m.Rewind(req_id=r, client_id=self.client_id, step=step))

    def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return self._call(
            lambda r: m.PublishVersion(req_id=r, client_id=self.client_id, version=version, step=step, weights=weights)
        )

    def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack:
        return self._call(
            lambda r: m.Control(
                req_id=r,
                client_id=self.client_id,
                action=cast(ControlAction, action),
                reason=reason,
                min_version=min_version,
                max_version=max_version,
                target=target,
            )
        )

    def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack:
        return self._call(
            lambda r: m.Heartbeat(req_id=r, client_id=self.client_id, policy_version=policy_version, stats=stats or {})
        )

    def current_version(self) -> m.CurrentVersion:
        return self._call(lambda r: m.GetVersion(req_id=r, client_id=self.client_id))

    def status(self) -> m.Status:
        return self._call(lambda r: m.GetStatus(req_id=r, client_id=self.client_id))

    def subscribe(self) -> InprocSubscription:
        q: deque = deque()
        self.broker.subscribers.append(q)
        return InprocSubscription(q)

    def close(self) -> None:
        pass
