"""Learner ranks watch each other (several ranks, usually across nodes).

A rank whose node drops off the network (a cut link, a dead switch port) stalls every collective of the
other ranks until the process group's timeout — 30 minutes by default — and the error that finally comes
names no rank. So every rank also keeps a heartbeat counter in the job's rendezvous store and reads the
others' counters (rank 0 reads every rank's, the others rank 0's). A rank whose counter has not moved for ``learner.peer_timeout_s``, or a store this rank
has not reached for that long, ends this rank at once with one line naming the silent rank(s) and their
host(s), exit code ``EXIT_PEER_LOST``. A launcher then fails the job with that cause (the Slurm job
driver: ``cluster.slurm.requeue_on_failure`` requeues it from the last checkpoint).

The store is MASTER_ADDR:MASTER_PORT: the TCPStore that torch.distributed's env:// rendezvous (or
torchrun's agent) serves on the first learner node for the life of the job. This module connects a client
of its own, with a short timeout, from a thread of its own; a second thread judges, so a store call stuck
behind a cut link cannot hold the verdict back. Rank 0 shares the store's node, so in a partition its
view names the cut-off side ("learner rank 1 on n3 not heard from"); the cut-off rank says it lost the
store. A rank that leaves cleanly marks it in the store and is not waited for; once rank 0 has left, the
others stop judging (the job is ending and the store goes with rank 0).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

log = logging.getLogger("fleetrl.learner")

EXIT_PEER_LOST = 7  # a learner rank's exit code when it ended because another rank (or the store) went silent
KEY = "fleetrl/peers/"


def connect_store(host: str, port: int, timeout_s: float):
    """A client of the rendezvous store at ``host:port`` (its server lives in rank 0's process or node)."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def fail_now(message: str) -> None:
    """End this rank now: the main thread may sit in a collective that will not return for half an hour."""
    log.error(message)
    print(f"fleetrl learner: FAILED: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)


class PeerWatch:
    """Heartbeats of ``world`` ranks in one store; ``on_lost(message)`` once when one goes silent."""

    def __init__(
        self,
        rank: int,
        world: int,
        host: str,
        timeout_s: float,
        connect: Callable[[float], object],
        store_where: str = "",
        on_lost: Callable[[str], None] = fail_now,
        heartbeat_s: float | None = None,
        prefix: str = KEY,
    ):
        self.rank, self.world, self.host, self.timeout_s, self.key = rank, world, host, timeout_s, prefix
        self.connect, self.store_where, self.on_lost = connect, store_where, on_lost
        self.heartbeat_s = heartbeat_s or min(1.0, timeout_s / 4)
        now = time.monotonic()
        self.last_ok = now  # the last time a round with the store completed
        # rank 0 (on the store's node) watches every rank; the others watch rank 0: ~3 x world store calls a second
        watched = range(1, world) if rank == 0 else [0]
        self.seen = {r: (-1, now) for r in watched}  # rank -> (its counter, when it last moved)
        self.hosts: dict[int, str] = {}
        self.left: set[int] = set()
        self.error = ""
        self.beating = threading.Event()  # set once a first round with the store completed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store = None
        self._threads = [
            threading.Thread(target=self._beat, name="peer-heartbeat", daemon=True),
            threading.Thread(target=self._judge, name="peer-judge", daemon=True),
        ]

    def start(self) -> PeerWatch:
        for t in self._threads:
            t.start()
        return self

    def stop(self, leaving: bool = True) -> None:
        """Stop watching; with ``leaving`` tell the others this rank is done (best effort)."""
        self._stop.set()
        store = self._store
        if leaving and store is not None:

            def mark() -> None:
                try:
                    store.set(f"{self.key}left/{self.rank}", "1")
                except Exception:  # noqa: BLE001 - on the way out; the others then name this rank after the timeout
                    pass

            t = threading.Thread(target=mark, daemon=True)  # a store behind a cut link must not hold the exit up
            t.start()
            t.join(2.0)

    # ------------------------------------------------------------------ the two threads
    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - a lost or refused store: reconnect next round, judged by time
                self._store, self.error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._stop.wait(self.heartbeat_s)

    def _round(self) -> None:
        if self._store is None:
            self._store = self.connect(max(1.0, min(5.0, self.timeout_s / 3)))
            self._store.set(f"{self.key}host/{self.rank}", self.host)
        store, key = self._store, self.key
        store.add(f"{key}beat/{self.rank}", 1)
        counts = {r: store.add(f"{key}beat/{r}", 0) for r in self.seen}
        left = {r for r in self.seen if store.check([f"{key}left/{r}"])}
        for r in set(counts) - set(self.hosts):
            if store.check([f"{key}host/{r}"]):
                self.hosts[r] = store.get(f"{key}host/{r}").decode()
        now = time.monotonic()
        with self._lock:
            for r, count in counts.items():
                if count != self.seen[r][0]:
                    self.seen[r] = (count, now)
            self.left, self.last_ok, self.error = left, now, ""
        self.beating.set()

    def _judge(self) -> None:
        while not self._stop.wait(min(0.5, self.heartbeat_s)):
            message = self.verdict(time.monotonic())
            if message:
                self._stop.set()
                self.on_lost(message)
                return

    def verdict(self, now: float) -> str:
        """Why this rank should end now ('' while every rank is heard from)."""
        with self._lock:
            if 0 in self.left:  # rank 0 finished: the job is ending and its store with it
                return ""
            if now - self.last_ok > self.timeout_s:
                return (
                    f"learner rank {self.rank} on {self.host} has not reached the rendezvous store{self.store_where} "
                    f"for {now - self.last_ok:.1f} s (learner.peer_timeout_s={self.timeout_s:g}): the network between "
                    f"them is down or that node is gone{f'; last error {self.error}' if self.error else ''}"
                )
            silent = [
                (r, now - t)
                for r, (_, t) in sorted(self.seen.items())
                if r not in self.left and now - t > self.timeout_s
            ]
        if not silent:
            return ""
        who = ", ".join(
            f"learner rank {r} on {self.hosts.get(r, '(host not yet known)')} not heard from for {s:.1f} s"
            for r, s in silent
        )
        return (
            f"{who} (learner.peer_timeout_s={self.timeout_s:g}, seen from rank {self.rank} on {self.host}): that node "
            "is cut off or the process froze; the collectives would wait for the process group's timeout, so this "
            "rank ends and the job fails with this cause (a launcher may requeue it from the last checkpoint)"
        )


def watch_peers(timeout_s: float, rank: int, world: int, env=os.environ) -> PeerWatch | None:
    """Start watching the other ranks of this learner (None with one rank, or with ``timeout_s`` 0)."""
    if world < 2 or timeout_s <= 0 or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
        return None
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's agent store outlives a restart of the ranks
    return PeerWatch(
        rank,
        world,
        socket.gethostname(),
        timeout_s,
        lambda t: connect_store(host, port, t),
        store_where=f" at {host}:{port} (learner rank 0's node)",
        prefix=f"{KEY}{restart}/",
    ).start()
