"""Learner ranks watch each other (learner/peers.py): a rank that goes silent — here frozen with SIGSTOP, which
looks to its peers like a cut link: its connections stay open and nothing comes — is named with its host
within learner.peer_timeout_s; a rank that left cleanly is not; a rank that loses the store says so."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from fleetrl.learner.peers import PeerWatch, connect_store, watch_peers

TIMEOUT_S = 5.0  # a loaded 2-core box (load 15+) delays a beat by 2 s and more
RANK = textwrap.dedent("""
    import sys, time
    import torch.distributed  # noqa: F401 - imported, as in a learner rank, before the watch starts
    from fleetrl.learner.peers import PeerWatch, connect_store
    rank, world, host, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    print("READY", flush=True)
    sys.stdin.readline()  # GO: every rank starts watching at once (after init_distributed's barrier, in a learner)
    w = PeerWatch(rank, world, host, 5.0, lambda t: connect_store("127.0.0.1", port, t),
                  on_lost=lambda m: print("LOST " + m, flush=True), heartbeat_s=0.2).start()
    assert w.beating.wait(60), "never reached the store"
    print("STARTED", flush=True)
    if mode == "leave":
        time.sleep(1.0)
        w.stop()
        print("LEFT", flush=True)
    time.sleep(60)
""")


def rank_processes(port: int, *ranks: tuple[int, int, str, str]) -> list[subprocess.Popen]:
    """Rank processes (rank, world, host, mode), each watching once all are told GO; returns once all beat."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(w), h, str(port), m],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, w, h, m in ranks
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "READY"
    return procs


def go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().strip() == "STARTED"


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(10)


class Lost:
    def __init__(self):
        self.messages: list[str] = []
        self.event = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.event.set()


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield server


def test_a_frozen_rank_is_named_with_its_host_within_the_timeout(store):
    lost = Lost()
    ranks = rank_processes(store.port, (1, 3, "hostB", "stay"), (2, 3, "hostC", "stay"))
    watch = PeerWatch(
        0, 3, "hostA", TIMEOUT_S, lambda t: connect_store("127.0.0.1", store.port, t), on_lost=lost, heartbeat_s=0.2
    ).start()
    go(ranks)
    try:
        assert watch.beating.wait(30)
        time.sleep(1.5)
        assert not lost.messages, lost.messages  # everyone heard from
        ranks[1].send_signal(signal.SIGSTOP)  # rank 2 goes silent; rank 1 keeps beating
        frozen = time.monotonic()
        assert lost.event.wait(TIMEOUT_S + 3), "rank 0 never named the frozen rank"
        took = time.monotonic() - frozen
        assert took <= TIMEOUT_S + 2, (
            took
        )  # (not earlier than the timeout after its last beat: a loaded box delays beats)
        (message,) = lost.messages
        assert "learner rank 2 on hostC not heard from" in message and "rank 1" not in message.split("(")[0], message
        assert "learner.peer_timeout_s=5" in message and "seen from rank 0 on hostA" in message
    finally:
        watch.stop()
        for p in ranks:
            stop(p)


def test_a_rank_that_left_is_not_waited_for_and_the_others_stop_judging_once_rank_0_left(store):
    lost = Lost()
    (rank1,) = rank_processes(store.port, (1, 2, "hostB", "leave"))
    watch = PeerWatch(
        0, 2, "hostA", TIMEOUT_S, lambda t: connect_store("127.0.0.1", store.port, t), on_lost=lost, heartbeat_s=0.2
    ).start()
    go([rank1])
    try:
        assert rank1.stdout.readline().strip() == "LEFT"
        assert not lost.event.wait(TIMEOUT_S + 2), lost.messages
    finally:
        watch.stop()
        stop(rank1)
    # rank 1's view: rank 0 left (the job is ending) and beats no more: no alarm
    lost1 = Lost()
    watch1 = PeerWatch(
        1, 2, "hostB", TIMEOUT_S, lambda t: connect_store("127.0.0.1", store.port, t), on_lost=lost1, heartbeat_s=0.2
    ).start()
    try:
        assert not lost1.event.wait(TIMEOUT_S + 1.5), lost1.messages
    finally:
        watch1.stop()


def test_a_rank_that_cannot_reach_the_store_says_so():
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys, time
        from datetime import timedelta
        from torch.distributed import TCPStore
        s = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        print(s.port, flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = int(server.stdout.readline())
    (rank0,) = rank_processes(port, (0, 2, "hostA", "stay"))
    lost = Lost()
    watch = PeerWatch(
        1,
        2,
        "hostB",
        TIMEOUT_S,
        lambda t: connect_store("127.0.0.1", port, t),
        on_lost=lost,
        store_where=" at hostA:1234 (learner rank 0's node)",
        heartbeat_s=0.2,
    ).start()
    go([rank0])
    try:
        assert watch.beating.wait(30)
        time.sleep(0.5)
        assert not lost.messages
        for p in (server, rank0):  # the store's node goes silent: store and rank 0 together
            p.send_signal(signal.SIGSTOP)
        assert lost.event.wait(TIMEOUT_S + 3), "the cut-off rank never noticed"
        message = lost.messages[0]
        assert (
            "learner rank 1 on hostB has not reached the rendezvous store at hostA:1234" in message
            or "learner rank 0 on hostA not heard from" in message
        ), message
    finally:
        watch.stop(leaving=False)
        for p in (server, rank0):
            stop(p)


def test_watch_peers_is_off_for_one_rank_or_a_zero_timeout():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert watch_peers(60, 0, 1, env) is None
    assert watch_peers(0, 0, 2, env) is None
    assert watch_peers(60, 0, 2, {}) is None
