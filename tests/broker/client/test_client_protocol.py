"""The role protocols (broker/client/roles.py): the socket client and the in-process twin satisfy every
sync role, the asyncio client every async role, method by method with the same signatures, so rollout
and learner code written against its role runs on any of them."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from fleetrl.broker.client import roles
from fleetrl.broker.client.ainproc import AsyncInprocBrokerClient
from fleetrl.broker.client.aio import AsyncBrokerClient
from fleetrl.broker.client.inproc import InprocBroker, InprocBrokerClient, InprocSubscription
from fleetrl.broker.client.roles import BrokerClient, SubscriptionLike
from fleetrl.broker.client.sync import Subscription, ZmqBrokerClient
from fleetrl.common import messages as m
from tests.broker.conftest import make_state


def methods(protocol: type) -> list[str]:
    """The calls a protocol declares, its bases' included."""
    names = {
        n
        for klass in protocol.__mro__
        if klass.__module__ == roles.__name__
        for n, v in vars(klass).items()
        if callable(v) and not n.startswith("_")
    }
    return sorted(names)


METHODS = methods(BrokerClient)
SYNC_ROLES = [roles.RolloutClient, roles.LearnerClient, roles.OperatorClient]
ASYNC_ROLES = [roles.AsyncRolloutClient, roles.AsyncLearnerClient, roles.AsyncOperatorClient]


def test_both_clients_satisfy_the_protocol():
    zmq_client = ZmqBrokerClient("tcp://127.0.0.1:9", "rollout-0", "rollout")  # never connected
    twin = InprocBroker(make_state()).client("rollout-0", "rollout")
    try:
        assert isinstance(zmq_client, BrokerClient) and isinstance(twin, BrokerClient)
        assert len(METHODS) >= 17
    finally:
        zmq_client.close()


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("impl", [ZmqBrokerClient, InprocBrokerClient])
def test_signatures_match_the_protocol(impl, name):
    want = inspect.signature(getattr(BrokerClient, name))
    got = inspect.signature(getattr(impl, name))
    strip = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
    assert strip(got) == strip(want), f"{impl.__name__}.{name}{got} differs from BrokerClient.{name}{want}"


def test_the_roles_split_the_calls_as_the_permission_table_does():
    rollout, learner, operator = (set(methods(r)) - set(methods(roles.Session)) for r in SYNC_ROLES)
    assert rollout == {"lease_prompts", "push_group", "push_groups", "return_prompts", "leave"}
    assert learner == {"lease_batch", "ack_batch", "commit", "rewind", "publish_version", "control", "leave"}
    assert operator == {"control"}
    assert set(METHODS) == set(methods(roles.Session)) | rollout | learner | operator


@pytest.mark.parametrize("impl", [AsyncBrokerClient, AsyncInprocBrokerClient], ids=lambda c: c.__name__)
@pytest.mark.parametrize("role", ASYNC_ROLES, ids=lambda r: r.__name__)
def test_the_async_clients_satisfy_every_async_role(role, impl):
    for name in methods(role):
        want, got = inspect.signature(getattr(role, name)), inspect.signature(getattr(impl, name))
        strip = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
        assert strip(got) == strip(want), f"{impl.__name__}.{name}{got} differs from {role.__name__}.{name}{want}"
        assert inspect.iscoroutinefunction(getattr(impl, name)), name


def test_the_async_in_process_twin_serves_a_rollout_and_a_learner():
    """Lease, push, lease a batch (a long poll that a push from the same loop wakes), ack: over the twin."""
    from tests.helpers import make_group

    broker = InprocBroker(make_state())

    async def run() -> tuple[int, int, int]:
        rollout = AsyncInprocBrokerClient(broker, "rollout-0", "rollout")
        learner = AsyncInprocBrokerClient(broker, "learner-0", "learner")
        await rollout.connect()
        await learner.connect()
        lease = await rollout.lease_prompts(3, 0)
        assert isinstance(lease, m.PromptLease)
        waiting = asyncio.ensure_future(learner.lease_batch(3, wait_s=10.0, min_groups=3))
        acks = await rollout.push_groups([make_group(p.prompt_id) for p in lease.prompts])
        batch = await waiting
        assert isinstance(batch, m.BatchLease)
        ack = await learner.ack_batch(batch.lease_id, [g.group_id for g in batch.groups], 1)
        return sum(a.status == "accepted" for a in acks), len(batch.groups), ack.count

    assert asyncio.run(run()) == (3, 3, 3)


def test_subscriptions_satisfy_theirs():
    assert issubclass(Subscription, SubscriptionLike) and issubclass(InprocSubscription, SubscriptionLike)


def test_the_sync_client_has_no_attribute_proxy():
    assert "__getattr__" not in vars(ZmqBrokerClient)  # explicit methods, not a proxy to the async client


def test_receivers_mirror_the_senders():
    from fleetrl.common.weightsync.receiver.receiver import RECEIVERS
    from fleetrl.common.weightsync.sender.publisher import SENDERS

    assert RECEIVERS.names() == SENDERS.names() == ["filesystem", "gloo", "nccl"]


def test_a_push_frame_reuses_groups_encoded_once():
    """Issue 24: the groups of a push are encoded once (size check, send, retries): the frame built from
    their pre-encoded bytes is byte for byte the frame of the groups themselves, for 1 to 20 groups."""
    from tests.helpers import make_group

    for n in (1, 15, 16, 20):
        groups = [make_group(f"0:{i}") for i in range(n)]
        plain = m.encode(m.PushGroups(req_id=9, client_id="r0", groups=groups))
        once = m.encode(m.PushGroups(req_id=9, client_id="r0", groups=[m.encode_raw(g) for g in groups]))
        assert once == plain and m.decode_request(once).groups[n - 1].group_id == groups[-1].group_id
        header = len(m.encode(m.PushGroups(req_id=9, client_id="r0", groups=[])))
        assert len(plain) == header + sum(len(m.encode_raw(g)) for g in groups) + (0 if n < 16 else 2)
