"""Weight receivers counted exactly (issue 26, item 5): a rollout server registers how many receivers it
has (a tensor-parallel vLLM server: one per worker), the broker reports the count, and the learner's
broadcast round waits for that many, not for one per server. Tested with two receivers per server."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.broker.client.metrics import expected_receivers, status_metrics
from fleetrl.common import messages as m
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, SyncConfig
from fleetrl.common.weightsync.receiver.receiver import WeightReceiver
from fleetrl.common.weightsync.sender.publisher import WeightPublisher
from tests.broker.conftest import make_state
from tests.common.weightsync.weights_child import CaptureEngine

LATE_S = 1.0  # how much later the server's second receiver (its second TP worker) hears of a round


def register(state, client_id: str, role: str = "rollout", **info: str) -> m.Message:
    return state.handle(m.Register(req_id=1, client_id=client_id, role=role, info=info), 0.0)


def test_the_broker_reports_each_servers_registered_receivers():
    state = make_state()
    assert isinstance(register(state, "rollout-0", receivers="2"), m.Registered)  # a TP=2 server
    assert isinstance(register(state, "rollout-1"), m.Registered)  # an HF server: one receiver
    assert isinstance(register(state, "learner-0", role="learner"), m.Registered)
    status = state.handle(m.GetStatus(req_id=2), 1.0)
    assert {c.client_id: c.receivers for c in status.clients} == {"rollout-0": 2, "rollout-1": 1, "learner-0": 1}
    assert expected_receivers(status) == 3  # not 2 servers
    metrics = status_metrics(status)
    assert metrics["fleet/servers"] == 2 and metrics["fleet/receivers"] == 3
    # through the wire format too (ClientInfo is array-like: the count rides at the end)
    assert m.decode_reply(m.encode(status)).clients[0].receivers == 2


def test_dead_servers_receivers_are_not_expected():
    state = make_state("broker.client_timeout_s=5")
    register(state, "rollout-0", receivers="4")
    state.handle(m.Heartbeat(req_id=3, client_id="rollout-0"), 0.0)
    register(state, "rollout-1", receivers="2")
    state.handle(m.Heartbeat(req_id=3, client_id="rollout-1"), 9.0)
    status = state.handle(m.GetStatus(req_id=2), 10.0)  # rollout-0 silent for 10 s > client_timeout_s
    assert expected_receivers(status) == 2


@pytest.mark.parametrize("bad", ["0", "-1", "two", "", "99999"])
def test_a_bad_receiver_count_is_refused_by_name_and_the_broker_keeps_serving(bad):
    state = make_state()
    reply = register(state, "rollout-0", receivers=bad)
    assert isinstance(reply, m.Error) and reply.code == "bad_request"
    assert "Register.info['receivers']" in reply.reason and repr(bad) in reply.reason
    assert isinstance(register(state, "rollout-0", receivers="1"), m.Registered)


def test_tensor_parallel_receivers_count_the_workers():
    from fleetrl.rollout.engines.vllm import WorkerReceivers

    class Workers:  # the part of VllmEngine WorkerReceivers uses: collective_rpc answers once per worker
        _aliases: dict = {}

        def __init__(self, n: int):
            self.n, self.calls = n, []

        def param_specs(self):
            return [("w", (2, 2), torch.float32)]

        def rpc(self, method, *args, timeout=None):
            self.calls.append(method)
            return [None] * self.n

    engine = Workers(4)
    assert WorkerReceivers(engine, JobConfig(), "rollout-0").receivers == 4 and engine.calls == ["fleetrl_init"]
    assert WeightReceiver.receivers == 1


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def test_a_round_waits_for_both_receivers_of_one_server(model, tmp_path):
    """One server, two receivers (its two TP workers), the second hearing of each round LATE_S later. The
    learner sizes the round from the broker's status: both are in the round, neither needs a catch-up. Sized
    by servers (the old count: 1) the round closes on the first join and the second receiver misses it."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=20.0, bucket_mb=0.1, catchup=False))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    pub = WeightPublisher(cfg, tmp_path, 0, [ws.make_spec(n, p.shape, p.dtype) for n, p in model.named_parameters()])
    workers = [WeightReceiver(cfg, specs, "cpu", "rollout-0") for _ in range(2)]
    state = make_state()
    register(state, "rollout-0", receivers=str(len(workers)))
    late: list[threading.Thread] = []

    def announce(version: int):
        def deliver(info: m.WeightsInfo) -> None:
            workers[0].on_version(version, info)
            t = threading.Timer(LATE_S, workers[1].on_version, (version, info))
            t.start()
            late.append(t)

        return deliver

    try:
        expected = expected_receivers(state.handle(m.GetStatus(req_id=2), 0.0))
        assert expected == 2
        t0 = time.monotonic()
        metrics = pub.publish(1, 1, model.named_parameters(), announce(1), expected)
        assert time.monotonic() - t0 >= LATE_S * 0.9  # it waited for the late one ...
        assert metrics["sync/receivers"] == 2 and metrics["sync/failed"] == 0  # ... and sent to both
        for w in workers:
            deadline = time.monotonic() + 20
            while w.pending_version() != 1:
                assert time.monotonic() < deadline, w.stats()
                time.sleep(0.01)
            engine = CaptureEngine(specs)
            assert w.apply(engine) == 1 and w.stats()["weights/rounds_missed"] == 0
            assert all(torch.equal(torch.as_tensor(engine.state[n]), p.detach()) for n, p in model.named_parameters())

        # The servers' count (1) against the same server: the round closes on the first join.
        metrics = pub.publish(2, 2, model.named_parameters(), announce(2), 1)
        assert metrics["sync/receivers"] == 1
        for t in late:
            t.join()
        time.sleep(0.5)  # the late receiver found the round closed: version 2 never reaches it in a round
        assert workers[0].pending_version() == 2 and workers[1].pending_version() is None
    finally:
        for t in late:
            t.cancel()
        for w in workers:
            w.close()
        pub.close()


def test_client_info_without_the_count_reads_as_one():
    """An older broker's ClientInfo (no trailing count) decodes with receivers=1, and ours decodes there."""

    class OldClientInfo(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
        client_id: str
        role: str
        rank: int = 0
        policy_version: int = 0
        last_seen_s: float = 0.0
        alive: bool = True
        stats: dict[str, float] = {}

    old = msgspec.msgpack.encode(OldClientInfo("rollout-0", "rollout", stats={"x": 1.0}))
    assert msgspec.msgpack.decode(old, type=m.ClientInfo).receivers == 1
    new = msgspec.msgpack.encode(m.ClientInfo("rollout-0", "rollout", receivers=2))
    assert msgspec.msgpack.decode(new, type=OldClientInfo).client_id == "rollout-0"
