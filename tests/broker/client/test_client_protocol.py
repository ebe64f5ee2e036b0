"""The `BrokerClient` protocol: the socket client and the in-process twin both satisfy it, method by
method with the same signatures, so rollout and learner code written against it runs on either."""

from __future__ import annotations

import inspect

import pytest

from fleetrl.broker.client.sync import BrokerClient, SubscriptionLike, Subscription, ZmqBrokerClient
from fleetrl.broker.client.inproc import InprocBroker, InprocBrokerClient, InprocSubscription
from tests.broker.conftest import make_state
from fleetrl.common import messages as m

METHODS = [name for name, v in vars(BrokerClient).items() if callable(v) and not name.startswith("_")]


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


def test_subscriptions_satisfy_theirs():
    assert issubclass(Subscription, SubscriptionLike) and issubclass(InprocSubscription, SubscriptionLike)


def test_the_sync_client_has_no_attribute_proxy():
    assert "__getattr__" not in vars(ZmqBrokerClient)  # explicit methods, not a proxy to the async client


def test_receivers_mirror_the_senders():
    from fleetrl.common.weightsync.sender.publisher import SENDERS
    from fleetrl.common.weightsync.receiver.receiver import RECEIVERS

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
