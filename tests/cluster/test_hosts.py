"""The many-hosts harness itself (tests/cluster/hosts.py): names resolve between hosts, a cut host is silent
(its processes live on) and comes back on restore, and everything made is removed, also when a test fails."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.hosts import NETNS_ETC, Hosts, HostsError

pytestmark = pytest.mark.cluster

# A TCP echo server on every address of its host, and a client that says what it got back (or why not).
SERVE = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode() + b":" + c.recv(100)); c.close()
"""
ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        c.sendall(b"ping"); print(c.recv(100).decode())
except OSError as e:
    print(type(e).__name__); sys.exit(3)
"""
PORT = 23999


def namespaces() -> set[str]:
    return {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.strip()
    }


def running(pid: int) -> bool:
    """Alive and not a zombie (PID 1 of this container does not reap the orphans it inherits)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def ask(hosts: Hosts, src: int, dst: str, timeout: float = 3.0) -> subprocess.CompletedProcess:
    return hosts.run(src, [sys.executable, "-c", ASK, dst, str(PORT), str(timeout)], timeout=timeout + 30)


def test_hosts_reach_each_other_by_name_and_lose_it_when_cut(hosts3):
    h = hosts3
    assert [h.run(i, ["hostname"]).stdout.strip() for i in range(3)] == h.names
    assert h.run(0, ["getent", "hosts", h.names[2]]).stdout.split() == [h.addrs[2], h.names[2]]
    server = h.popen(2, [sys.executable, "-c", SERVE, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"

    for src in (0, 1):
        out = ask(h, src, h.names[2])
        assert out.returncode == 0 and out.stdout.strip() == f"{h.names[2]}:ping", out.stdout + out.stderr

    # The host's own loopback is its own: host 0 has no server on 127.0.0.1:PORT.
    assert ask(h, 0, "127.0.0.1").stdout.strip() == "ConnectionRefusedError"

    h.cut(2)
    assert h.is_cut(2)
    t0 = time.monotonic()
    out = ask(h, 0, h.names[2], timeout=2.0)
    assert out.returncode == 3 and out.stdout.strip() == "TimeoutError", out.stdout  # silence, not a refusal
    assert time.monotonic() - t0 >= 1.5
    assert ask(h, 1, h.names[2], timeout=1.0).returncode == 3
    assert server.poll() is None  # the cut host's process lives on
    assert h.run(2, [sys.executable, "-c", ASK, "127.0.0.1", str(PORT), "2"]).returncode == 0  # and serves locally

    h.restore(2)
    assert not h.is_cut(2)
    out = ask(h, 0, h.names[2], timeout=5.0)
    assert out.returncode == 0 and out.stdout.strip() == f"{h.names[2]}:ping"


def test_close_removes_namespaces_links_files_and_processes_also_after_a_failure():
    with pytest.raises(ZeroDivisionError):
        with Hosts(2) as h:
            made = {h.switch, *h.names}
            assert made <= namespaces() and all((NETNS_ETC / n / "hosts").exists() for n in h.names)
            # a process that ignores SIGTERM, and one started inside a command (not held by the harness)
            stubborn = h.popen(
                1,
                [
                    sys.executable,
                    "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, "
                    "signal.SIG_IGN); print('up', flush=True); time.sleep(600)",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert stubborn.stdout.readline().strip() == "up"
            orphan = int(h.run(0, ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!"]).stdout)
            assert subprocess.run(["ip", "netns", "pids", h.names[0]], capture_output=True, text=True).stdout.split()
            raise ZeroDivisionError("a failure inside the block: everything is torn down all the same")
    assert not made & namespaces()
    assert not any((NETNS_ETC / n).exists() for n in made)
    assert stubborn.poll() is not None
    assert not running(orphan)


def test_a_bad_setup_fails_loudly_and_leaves_nothing(monkeypatch):
    h = Hosts(2)
    h.switch = "x" * 300  # `ip netns add` refuses a name this long
    with pytest.raises(HostsError, match="ip netns add"):
        h.start()
    assert not set(h.names) & namespaces()
    with pytest.raises(ValueError, match="n must be"):
        Hosts(0)
