"""Many hosts on one machine, for the cluster lane: each "host" is a network namespace with its own address
on a private bridge, its own hostname (UTS namespace) and an /etc/hosts that names every other host.

    with Hosts(3) as hosts:                       # root only; names like frqzkwa0, frqzkwa1, frqzkwa2
        hosts.run(0, ["hostname"])                # CompletedProcess; argv runs "on" host 0
        proc = hosts.popen(1, ["python", "-m", "http.server"])
        hosts.cut(1); ...; hosts.restore(1)       # host 1's cable pulled, then plugged back
    # everything it made is gone: processes it started, namespaces, links, /etc/netns/<name>

The layout (nothing is added to the machine's own namespace, no existing interface is touched):

    netns <prefix>sw:  bridge br0, one veth end per host (s0, s1, ...)
    netns <prefix>h<i>: lo, eth0 = 10.77.0.<i+1>/24 (the other end of s<i>), hostname <prefix><i>

Traffic stays on loopback and on 10.77.0.0/24 inside these namespaces. `cut(i)` sets the switch side of
host i's link down: the host keeps its address and its processes live on, but its packets go nowhere (a
peer sees silence, not a refused connection), like a pulled cable or a dead top-of-rack port.

Commands run through ``ip netns exec <ns> unshare --uts sh -c 'hostname <name>; exec ...'``: ``ip netns
exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over /etc/hosts (and gives the command its own mount
namespace); the filesystem is otherwise shared, so a run directory is "shared storage" for every host,
and munged's socket (a path) is reachable from all of them.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import string
import subprocess
import time
from pathlib import Path

SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")


class HostsError(RuntimeError):
    """Namespaces or links could not be made; the message names the command and what it said."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def missing() -> str:
    """Why hosts cannot be made here ('' when they can): root and the `ip`/`unshare` tools."""
    if os.geteuid() != 0:
        return "network namespaces need root; run the cluster lane (`make test-cluster`) as root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (Debian: apt-get install iproute2 util-linux)"
    return ""


class Hosts:
    """N hosts in network namespaces on a bridge of their own; stops and removes only what it made."""

    def __init__(self, n: int, prefix: str | None = None):
        if not 1 <= n <= 200:
            raise ValueError(f"Hosts(n={n}): n must be 1..200 (one address each in {SUBNET}.0/24)")
        self.n = n
        # letters only: Slurm hostlists read a name's trailing digits as the index (frqzkwa[0-3])
        self.prefix = prefix or "fr" + "".join(random.choices(string.ascii_lowercase, k=5))
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}{i}" for i in range(n)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in creation order
        self._closed = False

    # ------------------------------------------------------------------ setup / teardown
    def start(self) -> Hosts:
        why = missing()
        if why:
            raise HostsError(why)
        atexit.register(self.close)
        try:
            self._netns_add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            hosts_file = "127.0.0.1\tlocalhost\n" + "".join(f"{a}\t{h}\n" for a, h in zip(self.addrs, self.names))
            for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
                self._netns_add(ns)
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(hosts_file)
                (NETNS_ETC / ns / "hostname").write_text(ns + "\n")
                _ip("-n", self.switch, "link", "add", f"s{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", f"s{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"s{i}", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _netns_add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Stop the processes started here (their process groups), then anything still inside the namespaces
        (children of those), then remove the namespaces (with their links and bridge) and /etc/netns files."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        for ns in reversed(self._made):
            self._kill_inside(ns)
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()

    @staticmethod
    def _kill_inside(ns: str) -> None:
        """Processes left in one of our namespaces were started by this harness's commands: stop them."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 5
            while pids and time.monotonic() < end and _ip("netns", "pids", ns, check=False).stdout.split():
                time.sleep(0.1)

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ commands on a host
    def argv(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run in host ``host``'s namespaces, under its hostname."""
        name = self.names[host]
        return ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name, *argv]

    def run(self, host: int, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(host, argv), timeout=timeout, **kw)

    def popen(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        """A long-lived process on ``host`` in a session of its own; close() stops it (and its group)."""
        kw["start_new_session"] = True  # close() signals its process group
        proc = subprocess.Popen(self.argv(host, argv), **kw)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------ partitions
    def cut(self, host: int) -> None:
        """Pull host ``host``'s cable: the switch port goes down; the host and its processes live on."""
        _ip("-n", self.switch, "link", "set", f"s{host}", "down")

    def restore(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"s{host}", "up")

    def is_cut(self, host: int) -> bool:
        flags = re.search(r"<([^>]*)>", _ip("-n", self.switch, "-o", "link", "show", f"s{host}").stdout)
        return flags is None or "UP" not in flags.group(1).split(",")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # popen() gave it a session of its own: its group is ours
    except ProcessLookupError:
        pass
