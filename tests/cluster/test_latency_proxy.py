"""The cluster lane's latency proxy (tests/cluster/latency_proxy.py) on loopback, in the default suite (no root
needed): a round trip through it takes two one-way delays more, bytes arrive whole and in order, and the delay
file switches the delay while connections stay open."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.fixture
def proxied(tmp_path):
    srv, port = echo_server()
    ready, delay_file = tmp_path / "ready.json", tmp_path / "delay_ms"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.cluster.latency_proxy",
            "--route",
            f"127.0.0.1:0=127.0.0.1:{port}",
            "--delay-ms",
            "50",
            "--delay-file",
            str(delay_file),
            "--ready",
            str(ready),
        ],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)
        yield json.loads(ready.read_text())["ports"][0], delay_file
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        srv.close()


def round_trip(sock: socket.socket, payload: bytes) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(1 << 20)
    return time.perf_counter() - t0, got


def test_round_trips_take_two_delays_more_and_bytes_arrive_whole(proxied):
    port, delay_file = proxied
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = [round_trip(s, b"ping")[0] for _ in range(5)]
        assert 0.095 <= min(times) and max(times) < 0.5, times  # 2 x 50 ms through the proxy (there and back)
        payload = os.urandom(3 << 20)
        _, got = round_trip(s, payload)
        assert got == payload
        delay_file.write_text("0")
        time.sleep(0.5)  # the proxy reads the file every 0.2 s
        fast = [round_trip(s, b"ping")[0] for _ in range(5)]
        assert min(fast) < 0.05, fast  # the same connection, now without the added delay
