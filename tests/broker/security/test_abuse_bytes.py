"""Issue 31's memory and exhaustion attacks at their full sizes against a real broker process (slow lane): the
broker's peak RSS stays <= 500 MB and a normal client (the canary) is answered within 1 s throughout.

- 60 client ids of 16 MiB took the broker to 1 GB RSS; GetStatus then returned 960 MiB in 15.5 s (2 GB RSS);
- 50 stale groups with 16 MiB ids left +832 MB in the dedupe window;
- 40 held groups with 48 MiB metadata gave 3.9 GB RSS and one 1.9 GB LeaseBatch frame;
- a monitor key filled the 4,096-client table: a real rollout and a restarted learner got `unavailable`.
"""

from __future__ import annotations

import json
import threading
import time

import msgspec
import psutil
import pytest
import zmq
import zmq.auth

from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.broker.security.keys import generate
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig
from tests.broker.security.test_abuse import Canary, drain, zmtp_dealer
from tests.helpers import BrokerProcess, make_group, write_job

pytestmark = pytest.mark.slow
MIB = 1 << 20
RSS_MB = 500


class PeakRss:
    """The broker process's largest RSS, sampled every 20 ms while the attack runs."""

    def __init__(self, pid: int):
        self.proc, self.peak = psutil.Process(pid), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss / 1e6)
            time.sleep(0.02)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def ask(sock, frame: bytes) -> str:
    """Send one frame and wait for its reply (one at a time, as a client would); the reply's code or type."""
    sock.send(frame)
    assert sock.poll(30_000), "no reply"
    reply = m.decode_reply(sock.recv())
    return reply.code if isinstance(reply, m.Error) else type(reply).__name__


def tally(codes: list[str]) -> dict[str, int]:
    return {c: codes.count(c) for c in set(codes)}


def start(tmp_path, arith_data, **broker) -> BrokerProcess:
    job = write_job(tmp_path, arith_data, broker={"vocab_size": 263, "client_timeout_s": 600.0, **broker})
    return BrokerProcess(job, tmp_path / "run").start()


def test_sixty_client_ids_of_16_mib_and_a_status_of_the_whole_table(tmp_path, arith_data):
    proc = start(tmp_path, arith_data)
    try:
        canary, peak = Canary(proc.address), PeakRss(proc.proc.pid)
        sock = zmtp_dealer(proc.address)
        ids = tally(
            [
                ask(sock, m.encode(m.Register(req_id=i + 1, client_id=f"{i:02d}" + "x" * (16 * MIB), role="monitor")))
                for i in range(60)
            ]
        )
        stats = {f"stat/{k:04d}": float(k) for k in range(300)}  # ~16 KiB as counted: the most a heartbeat may carry
        for i in range(4000):  # the table filled with clients that each report that much
            sock.send(m.encode(m.Register(req_id=1, client_id=f"filler-{i}", role="rollout")))
            sock.send(m.encode(m.Heartbeat(req_id=2, client_id=f"filler-{i}", stats=stats)))
        filled = drain(sock, 8000)
        t0 = time.monotonic()
        status = canary.client.status()
        took, size = time.monotonic() - t0, len(m.encode(status))
        canary.stop()
        rss = peak.stop()
        sock.close()
        assert ids == {"too_large": 60}  # refused before decoding (and ids are at most 256 characters at decode)
        assert filled.get("Registered", 0) == 4000 and filled.get("Ack", 0) == 4000, filled
        assert size <= 8 * MIB + 64 * 1024 and took < 1.0, (size, took)  # was 960 MiB in 15.5 s
        assert status.counters["stats_dropped"] > 2000  # broker.max_client_table_bytes: the table's stats together
        assert rss <= RSS_MB, rss
        assert canary.failures == 0 and canary.worst < 1.0, (canary.failures, canary.worst)
    finally:
        proc.stop()


def test_fifty_stale_groups_with_16_mib_ids(tmp_path, arith_data):
    proc = start(tmp_path, arith_data, max_staleness=0)
    try:
        canary, peak = Canary(proc.address), PeakRss(proc.proc.pid)
        sock = zmtp_dealer(proc.address)
        codes = tally(
            [
                ask(
                    sock,
                    m.encode(
                        m.PushGroup(
                            req_id=i + 1,
                            client_id="canary-0",
                            group=make_group("0:0", gid=f"{i:02d}" + "s" * (16 * MIB)),
                        )
                    ),
                )
                for i in range(50)
            ]
        )
        seen = canary.client.status()
        canary.stop()
        rss = peak.stop()
        sock.close()
        assert codes == {"invalid_group": 50}, codes  # ids over 256 characters fail decoding: nothing remembered
        assert seen.groups_in == 0 and rss <= RSS_MB, rss
        assert canary.failures == 0 and canary.worst < 1.0, (canary.failures, canary.worst)
    finally:
        proc.stop()


def test_forty_groups_with_48_mib_metadata_and_held_groups_of_48_mib(tmp_path, arith_data):
    proc = start(tmp_path, arith_data)
    try:
        canary, peak = Canary(proc.address), PeakRss(proc.proc.pid)
        rollout = canary.client
        prompts = rollout.lease_prompts(8, 0).prompts
        sock = zmtp_dealer(proc.address)
        n = 48 * MIB
        junk = msgspec.Raw(b"\x81\xa4junk\xdd" + n.to_bytes(4, "big") + b"\x01" * n)  # 48 Mi small ints (~430 MB)
        codes = []
        for i in range(40):
            values = dict(
                zip(m.SampleGroup.__struct_fields__, msgspec.structs.astuple(make_group(prompts[i % 8].prompt_id)))
            )
            values["metadata"] = junk
            codes.append(
                ask(
                    sock,
                    msgspec.msgpack.encode(
                        [m.PushGroup.__struct_config__.tag, i + 1, "canary-0", list(values.values())]
                    ),
                )
            )
        codes = tally(codes)
        heavy = [make_group(p.prompt_id, t=3 * MIB) for p in prompts[:4]]  # 2 x 3 Mi tokens x 8 bytes: 48 MiB each
        acks = [
            rollout.request(lambda r, g=g: m.PushGroup(req_id=r, client_id="canary-0", group=g), raise_errors=False)
            for g in heavy
        ]
        learner = ZmqBrokerClient(proc.address, "learner-0", "learner", timeout_s=30.0)
        learner.connect()
        lease = learner.lease_batch(8)
        learner.close()
        canary.stop()
        rss = peak.stop()
        sock.close()
        assert codes == {"too_large": 40}, codes  # measured before decoding: broker.max_group_metadata_bytes
        taken = [a for a in acks if isinstance(a, m.Ack) and a.count]
        assert len(taken) == 2 and sum(isinstance(a, m.Throttle) for a in acks) == 2  # broker.max_held_bytes: 128 MiB
        assert len(lease.groups) == 2  # the lease frame is bounded by the same budget (was one 1.9 GB frame)
        assert rss <= RSS_MB, rss
        assert canary.failures == 0 and canary.worst < 1.0, (canary.failures, canary.worst)
    finally:
        proc.stop()


def test_a_monitor_key_flooding_the_table_crowds_out_no_fleet_role(tmp_path, arith_data):
    keys = tmp_path / "keys"
    generate(keys, {"rollout": ["rollout"], "learner": ["learner"], "monitor": ["grafana"]})
    curve = {
        "server_secret_key": str(keys / "server.key_secret"),
        "server_public_key": str(keys / "server.key"),
        "authorized_keys_dir": str(keys / "clients"),
    }
    proc = start(tmp_path, arith_data, curve=curve)
    as_key = lambda name: CurveConfig(**curve, client_secret_key=str(keys / f"{name}.key_secret"))  # noqa: E731
    try:
        ctx = zmq.Context()
        flood = ctx.socket(zmq.DEALER)
        public, secret = zmq.auth.load_certificate(str(keys / "grafana.key_secret"))
        flood.curve_publickey, flood.curve_secretkey = public, secret
        flood.curve_serverkey = zmq.auth.load_certificate(str(keys / "server.key"))[0]
        flood.setsockopt(zmq.SNDHWM, 0)
        flood.linger = 0
        flood.connect(proc.address)
        stop = threading.Event()

        def run() -> None:
            i = 0
            while not stop.is_set():
                flood.send(m.encode(m.Register(req_id=i + 1, client_id=f"grafana-{i}", role="monitor")))
                i += 1
                if i % 200 == 0:
                    time.sleep(0.01)

        threading.Thread(target=run, daemon=True).start()
        time.sleep(2.0)
        served = 0
        for attempt in range(10):  # a real rollout, and the learner restarted, every time
            for name, cid, role in (
                ("rollout", f"rollout-0-host-{attempt}", "rollout"),
                ("learner", "learner-0", "learner"),
            ):
                c = ZmqBrokerClient(proc.address, cid, role, timeout_s=5.0, curve=as_key(name))
                try:
                    served += isinstance(c.connect(), m.Registered)
                finally:
                    c.close()
        stop.set()
        status = ZmqBrokerClient(proc.address, "rollout-status", "rollout", curve=as_key("rollout"))
        status.connect()
        table = status.status()
        status.close()
        flood.close()
        ctx.term()
        audit = [json.loads(line) for line in (tmp_path / "run" / "audit.jsonl").read_text().splitlines()]
        throttled = [a for a in audit if a.get("event") == "key_throttled" and a.get("key") == "grafana"]
        assert served == 20  # was 0 of 10 over 75 s
        monitors = [c for c in table.clients if c.role == "monitor"]
        assert len(monitors) <= 256 and table.counters.get("key_throttled", 0) > 0
        assert 1 <= len(throttled) <= 2  # audited once per 10 s window, not once per refusal
    finally:
        proc.stop()
