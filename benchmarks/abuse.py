"""The broker under abuse (issue 16's targets): its RSS, and how fast a normal client is served meanwhile.

    python benchmarks/abuse.py [--seconds 10] [--out benchmarks/results/abuse.json]

A broker process with the default config (loopback, no spool) and, one after the other:

- **slowloris, multipart**: 4 raw ZMTP connections send 256 KiB frames flagged "more" as fast as
  loopback takes them, never a last frame (before: 1 GiB held in 3.6 s);
- **slowloris, half-sent frames**: 2,000 connections each announce a 512 KiB frame and send 100 bytes
  of it, then wait (before: open for more than 37 s);
- **100k clients**: 100,000 Registers with distinct client ids and 64-byte info;
- **10^6-group frame**: one PushGroups of a million tiny groups (before: the broker blocked 14.8 s).

During each, a normal client asks for the version every 50 ms; reported: the broker's peak RSS, the
canary's worst and p99 latency and failures, and what the broker closed or refused. Targets: RSS <
300 MB, the canary served within 1 s. The machine's load (1-min average, and the CPU other processes
used) is recorded so that figures from a busy box are flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetrl.broker.client.sync import ZmqBrokerClient  # noqa: E402
from fleetrl.common import messages as m  # noqa: E402
from fleetrl.common.telemetry.cpu import machine_busy_s  # noqa: E402
from tests.broker import zmtp  # noqa: E402
from tests.helpers import BrokerProcess, make_group, write_job  # noqa: E402

MIB = 1 << 20


class Watch:
    """Samples the broker's RSS and a canary client's latency on threads while an attack runs."""

    def __init__(self, broker: BrokerProcess):
        self.proc = psutil.Process(broker.proc.pid)
        self.client = ZmqBrokerClient(broker.address, "canary-0", "rollout", timeout_s=10.0)
        self.client.connect()
        self.rss, self.lat, self.failures = [], [], 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._sample, self._canary)]
        self.cpu0 = machine_busy_s()
        self.load0 = os.getloadavg()[0]
        for t in self._threads:
            t.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.rss.append(self.proc.memory_info().rss / MIB)
            time.sleep(0.05)

    def _canary(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.client.current_version()
                self.lat.append(time.monotonic() - t0)
            except Exception:  # noqa: BLE001 - counted
                self.failures += 1
            time.sleep(0.05)

    def stop(self) -> dict:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        status = self.client.status()
        self.client.close()
        lat = sorted(self.lat) or [float("nan")]
        busy = machine_busy_s() - self.cpu0
        return {
            "rss_peak_mib": round(max(self.rss), 1),
            "rss_start_mib": round(self.rss[0], 1),
            "canary_worst_s": round(lat[-1], 3),
            "canary_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3),
            "canary_requests": len(self.lat),
            "canary_failures": self.failures,
            "closed_connections": status.counters.get("connections_closed", 0),
            "rejected": dict(status.rejected),
            "load_1min": round(max(self.load0, os.getloadavg()[0]), 2),
            "machine_cpu_s": round(busy, 1),
        }


def multipart(address: str, seconds: float) -> dict:
    sent, stop = [0], time.monotonic() + seconds

    def flood() -> None:
        chunk = zmtp.frame(b"x" * (256 << 10), more=True)
        while time.monotonic() < stop:
            try:
                s = zmtp.connect(address)
                while time.monotonic() < stop:
                    s.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:
                continue  # closed by the broker: reconnect and go on

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"attack_mib_sent": round(sent[0] / MIB)}


def half_sent(address: str, seconds: float) -> dict:
    held = []
    for _ in range(2000):
        s = zmtp.connect(address)
        s.sendall(zmtp.frame_header(512 << 10) + b"y" * 100)
        held.append(s)
    time.sleep(seconds)
    for s in held:
        s.close()
    return {"connections": len(held)}


def many_clients(address: str, n: int = 100_000) -> dict:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    t0 = time.monotonic()
    for i in range(n):
        sock.send(m.encode(m.Register(req_id=i + 1, client_id=f"flood-{i}", role="rollout", info={"x": "y" * 64})))
    codes: dict[str, int] = {}
    for _ in range(n):
        if not sock.poll(30_000):
            break
        reply = m.decode_reply(sock.recv())
        key = reply.code if isinstance(reply, m.Error) else type(reply).__name__
        codes[key] = codes.get(key, 0) + 1
    sock.close()
    return {"registers": n, "replies": codes, "seconds": round(time.monotonic() - t0, 2)}


def million_groups(address: str) -> dict:
    import zmq

    one = m.encode(make_group("0:0", n=1, t=1))
    head = msgspec.msgpack.encode([m.PushGroups.__struct_config__.tag, 7, "canary-0"])
    frame = b"\x94" + head[1:] + b"\xdd" + (10**6).to_bytes(4, "big") + one * 10**6
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    t0 = time.monotonic()
    sock.send(frame)
    reply = m.decode_reply(sock.recv()) if sock.poll(60_000) else None
    sock.close()
    return {
        "frame_mib": round(len(frame) / MIB, 1),
        "reply": reply.code if isinstance(reply, m.Error) else str(reply),
        "reply_s": round(time.monotonic() - t0, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each slowloris attack")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "abuse.json"))
    args = ap.parse_args()
    from fleetrl.common.data.tasks import init_data

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, _ = init_data("arithmetic", str(tmp / "data.jsonl"), 200, 10, 0, 99)
        for name, attack in (
            ("slowloris_multipart", lambda a: multipart(a, args.seconds)),
            ("slowloris_half_sent_frames", lambda a: half_sent(a, args.seconds)),
            ("clients_100k", many_clients),
            ("frame_1e6_groups", million_groups),
        ):
            broker = BrokerProcess(
                write_job(tmp, str(data), broker={"port": 0, "pub_port": 0}), tmp / name, "telemetry.log_level=WARNING"
            ).start()
            try:
                watch = Watch(broker)
                time.sleep(0.5)
                detail = attack(broker.address)
                time.sleep(0.5)
                results[name] = {**detail, **watch.stop()}
            finally:
                broker.stop()
            r = results[name]
            print(
                f"{name:28s} RSS peak {r['rss_peak_mib']:7.1f} MiB (start {r['rss_start_mib']:.1f})  canary worst "
                f"{r['canary_worst_s']:.3f} s p99 {r['canary_p99_s']:.3f} s failures {r['canary_failures']}  "
                f"load {r['load_1min']}",
                flush=True,
            )
    results["targets"] = {
        "rss_mib": 300,
        "canary_s": 1.0,
        "met": all(
            r["rss_peak_mib"] < 300 and r["canary_worst_s"] < 1.0 and not r["canary_failures"]
            for k, r in results.items()
            if k != "targets"
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"targets met: {results['targets']['met']}; saved to {args.out}")


if __name__ == "__main__":
    main()
