"""The asyncio twin of the in-process client: every async role (``roles.py``) over an ``InprocBroker``.

Code written against ``AsyncRolloutClient`` / ``AsyncLearnerClient`` (an asyncio rollout loop, an async
test) runs on it without sockets, as sync code runs on ``InprocBrokerClient``. Each call hands the sync
twin's call to a worker thread (``asyncio.to_thread``): the state machine behind it is guarded by the
broker's lock, and a long poll (``lease_batch`` with ``wait_s``) waits there without stalling the loop.
"""

from __future__ import annotations

import asyncio

from fleetrl.broker.client.inproc import InprocBroker, InprocBrokerClient
from fleetrl.common import messages as m


class AsyncInprocBrokerClient:
    def __init__(self, broker: InprocBroker, client_id: str, role: str, rank: int = 0):
        self.sync = InprocBrokerClient(broker, client_id, role, rank)
        self.client_id = client_id

    @property
    def registered(self) -> m.Registered | None:
        return self.sync.registered

    async def connect(self, timeout_s: float | None = None) -> m.Registered:
        return await asyncio.to_thread(self.sync.connect, timeout_s)

    async def lease_prompts(self, n: int, policy_version: int) -> m.PromptLease | m.Throttle:
        return await asyncio.to_thread(self.sync.lease_prompts, n, policy_version)

    async def push_group(self, group: m.SampleGroup, deadline_s: float = 600.0) -> m.Ack:
        return await asyncio.to_thread(self.sync.push_group, group, deadline_s)

    async def push_groups(self, groups: list[m.SampleGroup], deadline_s: float = 600.0) -> list[m.GroupAck]:
        return await asyncio.to_thread(self.sync.push_groups, groups, deadline_s)

    async def return_prompts(self, lease_id: str, prompt_ids: list[str] | None = None, unscored: bool = False) -> m.Ack:
        return await asyncio.to_thread(self.sync.return_prompts, lease_id, prompt_ids, unscored)

    async def leave(self, reason: str = "", done: bool = False, timeout_s: float = 5.0) -> m.Ack:
        return await asyncio.to_thread(self.sync.leave, reason, done)  # in-process: no reply to wait for

    async def lease_batch(
        self, n: int, wait_s: float = 0.0, min_groups: int = 1, for_version: int = 0
    ) -> m.BatchLease | m.Throttle:
        return await asyncio.to_thread(self.sync.lease_batch, n, wait_s, min_groups, for_version)

    async def ack_batch(
        self, lease_id: str, group_ids: list[str], step: int, keep_rest: bool = False, give_back: bool = False
    ) -> m.Ack:
        return await asyncio.to_thread(self.sync.ack_batch, lease_id, group_ids, step, keep_rest, give_back)

    async def commit(self, step: int) -> m.Ack:
        return await asyncio.to_thread(self.sync.commit, step)

    async def rewind(self, step: int) -> m.Ack:
        return await asyncio.to_thread(self.sync.rewind, step)

    async def publish_version(self, version: int, step: int, weights: m.WeightsInfo) -> m.Ack:
        return await asyncio.to_thread(self.sync.publish_version, version, step, weights)

    async def control(
        self, action: str, reason: str = "", min_version: int = 0, max_version: int = -1, target: str = ""
    ) -> m.Ack:
        return await asyncio.to_thread(self.sync.control, action, reason, min_version, max_version, target)

    async def heartbeat(self, policy_version: int, stats: dict[str, float] | None = None) -> m.Ack:
        return await asyncio.to_thread(self.sync.heartbeat, policy_version, stats)

    async def current_version(self) -> m.CurrentVersion:
        return await asyncio.to_thread(self.sync.current_version)

    async def status(self) -> m.Status:
        return await asyncio.to_thread(self.sync.status)

    async def close(self) -> None:
        self.sync.close()
