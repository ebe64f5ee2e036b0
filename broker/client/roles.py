"""What each role may call on the broker, as protocols: the permission table (``security/permissions.py``) as types.

| protocol | calls (beyond ``Session``'s: connect, heartbeat, current_version, status, subscribe, close) |
| --- | --- |
| ``RolloutClient`` | lease_prompts, push_group(s), return_prompts, leave |
| ``LearnerClient`` | lease_batch, ack_batch, commit, rewind, publish_version, control (its rollback), leave |
| ``OperatorClient`` | control |

``ZmqBrokerClient`` (``sync.py``) and ``InprocBrokerClient`` (``inproc.py``) implement every sync role;
``AsyncBrokerClient`` (``aio.py``, ZeroMQ) and ``AsyncInprocBrokerClient`` (``ainproc.py``) the async twins
(``AsyncRolloutClient``, ...: the same calls, awaited).

A rollout server is written against ``RolloutClient``, a learner rank against ``LearnerClient``, the
`fleetrl control` command against ``OperatorClient``; each client class implements them all (the broker
enforces the table whatever a client calls). ``tests/broker/client/test_client_protocol.py`` checks every
implementation method by method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from fleetrl.common import messages as m


@runtime_checkable
class SubscriptionLike(Protocol):
    """Announcements (version, control) as they arrive."""

    def next(self, timeout_s: float = 0.0) -> m.Announcement | None: ...

    def wake(self) -> None:
        """(any thread) End a wait in `next` now, without an announcement: it returns None."""

    def drain(self) -> list[m.Announcement]: ...


@runtime_checkable
class Session(Protocol):
    """What every role calls: register, stay alive, read the version and status, listen, go."""

    client_id: str

    @property
    def registered(self) -> m.Registered | None: ...

    def connect(self, timeout_s: float | None = None) -> m.Registered: ...

    def start_heartbeat(self, stats: Callable[[], tuple[int, dict[str, float]]], interval_s: float) -> None: ...

    def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack: ...

    def current_version(self) -> m.CurrentVersion: ...

    def status(self) -> m.Status: ...

    def subscribe(self) -> SubscriptionLike: ...

    def close(self) -> None: ...


@runtime_checkable
class RolloutClient(Session, Protocol):
    """A rollout server: leases prompts, pushes scored groups, returns what it could not finish."""

    def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle: ...

    def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack: ...

    def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]: ...

    def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack: ...

    def leave(self, reason: str = "", done: bool = False) -> m.Ack: ...


@runtime_checkable
class LearnerClient(Session, Protocol):
    """A learner rank: leases and acknowledges batches, commits and rewinds, publishes versions, and pauses,
    discards and resumes during its rollback, and quarantines a rollout server."""

    def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle: ...

    def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack: ...

    def commit(self, step: int) -> m.Ack: ...

    def rewind(self, step: int) -> m.Ack: ...

    def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack: ...

    def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack: ...

    def leave(self, reason: str = "", done: bool = False) -> m.Ack: ...


@runtime_checkable
class OperatorClient(Session, Protocol):
    """An operator: pauses, resumes and stops the fleet, discards versions, quarantines and releases servers."""

    def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack: ...


@runtime_checkable
class BrokerClient(RolloutClient, LearnerClient, OperatorClient, Protocol):
    """Every call of every role: what each client class implements."""


# ---------------------------------------------------------------------------------- asyncio


@runtime_checkable
class AsyncSession(Protocol):
    client_id: str

    async def connect(self, timeout_s: float | None = None) -> m.Registered: ...

    async def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack: ...

    async def current_version(self) -> m.CurrentVersion: ...

    async def status(self) -> m.Status: ...

    async def close(self) -> None: ...


@runtime_checkable
class AsyncRolloutClient(AsyncSession, Protocol):
    async def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle: ...

    async def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack: ...

    async def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]: ...

    async def return_prompts(
        self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False
    ) -> m.Ack: ...

    async def leave(self, reason: str = "", done: bool = False, timeout_s: float = 5.0) -> m.Ack: ...


@runtime_checkable
class AsyncLearnerClient(AsyncSession, Protocol):
    async def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle: ...

    async def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack: ...

    async def commit(self, step: int) -> m.Ack: ...

    async def rewind(self, step: int) -> m.Ack: ...

    async def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack: ...

    async def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack: ...

    async def leave(self, reason: str = "", done: bool = False, timeout_s: float = 5.0) -> m.Ack: ...


@runtime_checkable
class AsyncOperatorClient(AsyncSession, Protocol):
    async def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack: ...
