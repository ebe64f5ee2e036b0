"""The broker over real sockets on loopback: a `fleetrl broker` child process per test module."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from fleetrl.broker.client.errors import BrokerError, BrokerUnauthorized, BrokerUnavailable
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.broker.security.keys import generate
from fleetrl.common import messages as m
from tests.helpers import BrokerProcess, make_group, write_job


@pytest.fixture
def job(tmp_path, arith_data):
    return write_job(
        tmp_path, arith_data, learner={"groups_per_step": 4}, broker={"max_message_bytes": 4096, "vocab_size": 263}
    )


@pytest.fixture
def broker(tmp_path, job):
    proc = BrokerProcess(job, tmp_path / "run").start()
    yield proc
    assert proc.stop() == 0  # SIGTERM: clean exit


def client(address, cid="r0", role="rollout", **kw) -> ZmqBrokerClient:
    c = ZmqBrokerClient(address, cid, role, timeout_s=kw.pop("timeout_s", 5.0), **kw)
    c.connect()
    return c


def test_happy_path_and_announcements(broker):
    rollout, learner = client(broker.address), client(broker.address, "learner-0", "learner")
    try:
        sub = rollout.subscribe()
        time.sleep(0.3)  # PUB/SUB: the subscription takes effect asynchronously
        lease = rollout.lease_prompts(4, 0)
        assert isinstance(lease, m.PromptLease) and len(lease.prompts) == 4
        groups = [make_group(p.prompt_id) for p in lease.prompts]
        acks = [rollout.push_group(g) for g in groups]
        assert [a.ref for a in acks] == [g.group_id for g in groups] and all(a.count == 1 for a in acks)
        batch = learner.lease_batch(4, wait_s=2.0, min_groups=4)
        assert [g.group_id for g in batch.groups] == [g.group_id for g in groups]
        assert batch.groups[0] == groups[0]  # bytes, rewards, ids: all intact
        assert learner.ack_batch(batch.lease_id, [g.group_id for g in batch.groups], 1).count == 4
        learner.publish_version(1, 1, m.WeightsInfo(transport="filesystem", path="/tmp/w1"))
        ann = sub.next(timeout_s=2.0)
        assert isinstance(ann, m.VersionAnnouncement) and ann.version == 1 and ann.weights.path == "/tmp/w1"
        late = client(broker.address, "r-late")
        assert late.registered.policy_version == 1 and late.current_version().weights.path == "/tmp/w1"
        status = late.status()
        assert (status.groups_in, status.groups_out, status.queue_depth) == (4, 4, 0)
        assert {c.client_id for c in status.clients} >= {"r0", "learner-0", "r-late"}
        late.close()
    finally:
        rollout.close()
        learner.close()


def test_a_subscription_wait_ends_on_wake_and_loses_no_announcement(broker):
    """`wake` (another thread) ends a long `next` at once with None; an announcement around it still arrives,
    once, and `drain` never returns the wake itself (the rollout's loop loads a received version this way)."""
    rollout, learner = client(broker.address), client(broker.address, "learner-0", "learner")
    try:
        sub = rollout.subscribe()
        time.sleep(0.3)  # PUB/SUB: the subscription takes effect asynchronously
        threading.Timer(0.2, sub.wake).start()
        t0 = time.monotonic()
        assert sub.next(timeout_s=30.0) is None
        assert time.monotonic() - t0 < 10
        sub.wake()
        learner.publish_version(1, 1, m.WeightsInfo())
        time.sleep(0.3)
        sub.wake()
        assert [a.version for a in sub.drain()] == [1]
        assert sub.next(timeout_s=0.0) is None and sub.drain() == []
    finally:
        rollout.close()
        learner.close()


def test_duplicate_and_invalid_groups_over_the_wire(broker):
    c = client(broker.address)
    try:
        lease = c.lease_prompts(2, 0)
        g = make_group(lease.prompts[0].prompt_id)
        assert c.push_group(g).count == 1 and c.push_group(g).duplicate
        with pytest.raises(BrokerError) as e:
            c.push_group(make_group(lease.prompts[1].prompt_id, token=10_000))
        assert e.value.code == "invalid_group" and "outside the vocabulary" in e.value.reason
        big = make_group(lease.prompts[1].prompt_id, t=300)  # ~4.8 KB > broker.max_message_bytes=4096
        with pytest.raises(BrokerError) as e:
            c.push_group(big)  # refused by the client before sending
        assert e.value.code == "too_large" and "broker.max_message_bytes" in e.value.reason
        frame = m.encode(m.PushGroup(req_id=78, client_id="r0", group=big))
        reply = _raw_roundtrip(broker.address, [frame])[0]  # and by the broker when sent anyway
        assert reply.req_id == 78 and reply.code == "too_large" and "broker.max_message_bytes" in reply.reason
        # a frame with a NaN reward is answered with a typed error matched to its request
        raw = msgspec.msgpack.decode(m.encode(m.PushGroup(req_id=77, client_id="r0", group=make_group("0:1"))))
        raw[3][7][0] = float("nan")  # group.rewards[0]
        reply = _raw_roundtrip(broker.address, [msgspec.msgpack.encode(raw)])[0]
        assert reply.req_id == 77 and reply.code == "invalid_group" and "reward that is not finite" in reply.reason
        rejected = c.status().rejected
        assert rejected == {"invalid_group": 2, "too_large": 1}
    finally:
        c.close()


def _raw_roundtrip(address: str, frames: list[bytes], multipart: bool = False, timeout: float = 10.0) -> list:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    try:
        if multipart:
            sock.send_multipart(frames)
            expected = 1
        else:
            for f in frames:
                sock.send(f)
            expected = len(frames)
        replies = []
        deadline = time.monotonic() + timeout
        while len(replies) < expected and time.monotonic() < deadline:
            if sock.poll(200):
                replies.append(m.decode_reply(sock.recv()))
        return replies
    finally:
        sock.close()
        ctx.term()


def test_garbage_frames_get_typed_errors_and_broker_keeps_serving(broker):
    rng = random.Random(1)
    good = m.encode(m.PushGroup(req_id=1, client_id="fuzz", group=make_group("0:1")))
    frames = [rng.randbytes(rng.randint(1, 200)) for _ in range(900)] + [
        good[: rng.randint(1, len(good) - 1)] for _ in range(100)
    ]
    replies = _raw_roundtrip(broker.address, frames)
    assert len(replies) == 1000 and all(isinstance(r, m.Error) for r in replies)
    assert {r.code for r in replies} <= {"bad_frame", "invalid_group"}
    multi = _raw_roundtrip(broker.address, [b"a", b"b", b"c"], multipart=True)
    assert multi[0].code == "bad_frame" and "one payload frame" in multi[0].reason
    c = client(broker.address)
    try:
        assert isinstance(c.lease_prompts(1, 0), m.PromptLease)
        assert sum(c.status().rejected.values()) == 1001
    finally:
        c.close()


def test_a_long_client_id_is_refused_and_never_registered(broker):
    """Issue 31: client ids of 16 MiB filled the client table and a GetStatus reply; now refused at decode."""
    frames = [m.encode(m.Register(req_id=i + 1, client_id=f"{i}-" + "x" * 3000, role="rollout")) for i in range(20)]
    replies = _raw_roundtrip(broker.address, frames)
    assert all(
        isinstance(r, m.Error) and r.code == "bad_frame" and "at most 256 characters" in r.reason for r in replies
    )
    c = client(broker.address)
    try:
        assert isinstance(c.lease_prompts(1, 0), m.PromptLease)
        assert all(len(info.client_id) <= m.MAX_ID_CHARS for info in c.status().clients)
    finally:
        c.close()


def test_learner_long_poll_is_answered_when_groups_arrive(broker):
    rollout, learner = client(broker.address), client(broker.address, "learner-0", "learner")
    try:
        lease = rollout.lease_prompts(2, 0)
        result = {}
        waiter = threading.Thread(target=lambda: result.update(b=learner.lease_batch(2, wait_s=5.0, min_groups=2)))
        t0 = time.monotonic()
        waiter.start()
        time.sleep(0.3)
        for p in lease.prompts:
            rollout.push_group(make_group(p.prompt_id))
        waiter.join()
        assert isinstance(result["b"], m.BatchLease) and len(result["b"].groups) == 2
        assert time.monotonic() - t0 < 3.0  # answered on arrival, not at the deadline
        empty = learner.lease_batch(1, wait_s=0.3)
        assert isinstance(empty, m.Throttle)
    finally:
        rollout.close()
        learner.close()


def test_unreachable_broker_error_names_the_setting():
    c = ZmqBrokerClient("tcp://127.0.0.1:9", "r0", "rollout", timeout_s=0.3)
    with pytest.raises(BrokerUnavailable, match="broker.request_timeout_s"):
        c.connect()


def test_status_cli(broker):
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "status", "--broker", broker.address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert '"queue_depth": 0' in out.stdout and '"broker/queue_depth": 0' in out.stdout
    table = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "status", "--broker", broker.address],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "queue depth" in table and "policy version 0" in table


def test_sigkill_mid_stream_loses_no_acknowledged_group(tmp_path, arith_data):
    job = write_job(
        tmp_path, arith_data, broker={"spool_dir": str(tmp_path / "spool"), "fsync": "never", "queue_capacity": 100000}
    )
    proc = BrokerProcess(job, tmp_path / "run").start()
    acked: list[str] = []
    stop = threading.Event()

    def pusher() -> None:
        c = ZmqBrokerClient(proc.address, "r0", "rollout", timeout_s=1.0)
        c.connect()
        try:
            while not stop.is_set():
                try:
                    lease = c.lease_prompts(8, 0)
                    for p in getattr(lease, "prompts", []):
                        g = make_group(p.prompt_id)
                        c.push_group(g, deadline_s=0.0)
                        acked.append(g.group_id)
                except (BrokerUnavailable, BrokerError):
                    return
        finally:
            c.close()

    t = threading.Thread(target=pusher)
    t.start()
    while len(acked) < 200:
        time.sleep(0.01)
    proc.kill()  # SIGKILL, mid-stream
    stop.set()
    t.join()
    n_acked = len(acked)
    proc2 = BrokerProcess(job, tmp_path / "run2").start()
    learner = ZmqBrokerClient(proc2.address, "learner-0", "learner", timeout_s=5.0)
    learner.connect()
    try:
        got: list[str] = []
        while True:
            b = learner.lease_batch(64, wait_s=0.2)
            if not isinstance(b, m.BatchLease):
                break
            got += [g.group_id for g in b.groups]
        assert len(got) == len(set(got)), "a group came back twice"
        missing = set(acked[:n_acked]) - set(got)
        assert not missing, f"{len(missing)} acknowledged groups lost"
        assert len(got) - n_acked <= 1  # at most the one in flight when killed
    finally:
        learner.close()
        assert proc2.stop() == 0


def test_curve_known_key_served_unknown_refused(tmp_path, arith_data):
    keys = tmp_path / "keys"
    generate(keys, {"rollout": ["rollout"], "learner": ["learner"]})
    generate(tmp_path / "other", {"rollout": ["intruder"]})  # a well-formed key the broker does not know
    curve = {
        "server_secret_key": str(keys / "server.key_secret"),
        "server_public_key": str(keys / "server.key"),
        "authorized_keys_dir": str(keys / "clients"),
    }
    job = write_job(tmp_path, arith_data, broker={"curve": curve})
    proc = BrokerProcess(job, tmp_path / "run").start()
    from fleetrl.common.config.schema import CurveConfig

    try:
        rollout = client(
            proc.address, "rollout-0", curve=CurveConfig(**curve, client_secret_key=str(keys / "rollout.key_secret"))
        )
        learner = client(
            proc.address,
            "learner-0",
            "learner",
            curve=CurveConfig(**curve, client_secret_key=str(keys / "learner.key_secret")),
        )
        assert isinstance(rollout.lease_prompts(1, 0), m.PromptLease)
        assert rollout.registered.identity == "rollout" and rollout.registered.role == "rollout"
        sub = rollout.subscribe()
        time.sleep(0.5)  # PUB/SUB: a subscription takes effect after its (CURVE) handshake
        learner.publish_version(2, 2, m.WeightsInfo())
        assert sub.next(timeout_s=2.0).version == 2  # encrypted PUB works too
        rollout.close()
        learner.close()
        bad = CurveConfig(**curve, client_secret_key=str(tmp_path / "other" / "intruder.key_secret"))
        with pytest.raises(BrokerUnauthorized, match="authorized_keys_dir"):
            client(proc.address, "intruder", curve=bad, timeout_s=3.0)
        # issue 31: a key the broker cannot even read (a wrong server key) was BrokerUnavailable after the timeout
        wrong = CurveConfig(
            **{**curve, "server_public_key": str(tmp_path / "other" / "intruder.key")},
            client_secret_key=str(keys / "rollout.key_secret"),
        )
        with pytest.raises(BrokerUnauthorized, match="server_public_key"):
            client(proc.address, "rollout-1", curve=wrong, timeout_s=2.0)
        plain = ZmqBrokerClient(proc.address, "plain", "rollout", timeout_s=0.5)
        with pytest.raises(BrokerUnavailable):
            plain.connect()
    finally:
        assert proc.stop() == 0


def test_status_cli_takes_a_run_directory_and_says_what_is_wrong(tmp_path, broker):
    run_dir = tmp_path / "status-run"
    run_dir.mkdir()
    (run_dir / "broker.json").write_text(json.dumps({"address": broker.address}))
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "status", "--broker", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert '"queue_depth": 0' in out.stdout
    for target, says in (
        (tmp_path / "status-run" / "..", "holds no broker.json"),
        (tmp_path / "nope", "neither an address"),
    ):
        bad = subprocess.run(
            [sys.executable, "-m", "fleetrl.app.cli", "status", "--broker", str(target)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 1 and says in bad.stderr and "Traceback" not in bad.stdout + bad.stderr


def test_a_client_that_left_is_not_registered_again_by_a_later_request(broker):
    """A rollout stopped by SIGTERM left the fleet, then its heartbeat (racing the stop) got "unregistered" and
    registered it again: the fleet counted it for broker.client_timeout_s and every weight round waited 5 s for
    it (a CI failure of tests/e2e/test_lifecycle.py). A client that left stays gone."""
    rollout, operator = client(broker.address, "r-leaving"), client(broker.address, "op", "operator")
    try:

        def listed() -> bool:
            return any(c.client_id == "r-leaving" for c in operator.status().clients)

        assert listed()
        rollout.leave("stop requested")
        assert not listed()
        with pytest.raises(BrokerError) as e:
            rollout.heartbeat(0)
        assert e.value.code == "unregistered"
        assert not listed() and rollout.client.reregistered == 0
    finally:
        rollout.close()
        operator.close()
