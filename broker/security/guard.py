"""Bounds on what connections may cost the broker: memory in unfinished frames, idle descriptors.

libzmq has no limit on an unfinished multipart message (its frames are buffered until the last one
arrives, and the receive high-water mark counts whole messages only), and a peer that never finishes
a frame, or never sends one, keeps its descriptor forever. The guard watches every connection of the
request socket and closes the ones that cost too much; a ZeroMQ client reconnects by itself, so a
well-behaved client that is cut loses at most a request in flight, which it retries.

- It learns each connection's descriptor from the socket monitor (``EVENT_ACCEPTED``) and the bytes
  the kernel received on it from ``TCP_INFO`` (``tcpi_bytes_received``, Linux).
- The server reports every request it reads with its source descriptor (``ZMQ_SRCFD``), so the guard
  knows what was delivered. Received minus delivered (less a small per-message and per-heartbeat
  allowance for framing) is what the connection holds inside libzmq.
- A connection holding more than ``2 x broker.max_message_bytes + 1 MiB`` is closed; while all
  together hold more than ``broker.max_buffered_bytes``, the largest holders are closed.
- A connection that delivered no request for ``broker.idle_timeout_s`` and has no long poll waiting
  is closed; so are the idlest ones beyond ``broker.max_connections``.

Closing is ``shutdown(SHUT_RDWR)`` on the descriptor (never ``close``: it stays libzmq's): libzmq sees the
peer go away and frees the connection and its buffers itself.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from fleetrl.common.config.schema import BrokerConfig

log = logging.getLogger(__name__)

TCPI_BYTES_RECEIVED = 128  # offset of the u64 in struct tcp_info (Linux >= 4.1)
PER_MESSAGE = 64  # framing (and CURVE box) bytes allowed per delivered request
BASE_ALLOWANCE = 8192  # greeting, handshake
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass
class Conn:
    fd: int
    since: float
    last_request: float
    delivered: int = 0
    messages: int = 0
    held: int = 0  # last estimate of bytes held inside libzmq


@dataclass
class Guard:
    bcfg: BrokerConfig
    max_connections: int
    counters: Counter = field(default_factory=Counter)
    conns: dict[int, Conn] = field(default_factory=dict)
    monitor: zmq.Socket | None = None
    tcp_info: bool = True
    held: int = 0  # bytes all connections held at the last check

    @classmethod
    def attach(cls, sock: zmq.Socket, bcfg: BrokerConfig, counters: Counter, open_files: int) -> Guard:
        limit = bcfg.max_connections or max(16, open_files - 64)
        g = cls(bcfg, limit, counters)
        g.monitor = sock.get_monitor_socket(EVENTS)
        return g

    @property
    def under_pressure(self) -> bool:
        """Connections hold a quarter of the budget: look again in 10 ms, not at the next tick."""
        return self.held > self.bcfg.max_buffered_bytes // 4

    @property
    def per_connection(self) -> int:
        return 2 * self.bcfg.max_message_bytes + (1 << 20)

    def events(self, now: float) -> None:
        """Apply the monitor's connection events (accepted / gone)."""
        while self.monitor is not None:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.conns[fd] = Conn(fd, now, now)
            else:
                self.conns.pop(fd, None)

    def delivered(self, fd: int, nbytes: int, now: float) -> None:
        c = self.conns.get(fd)
        if c is None:  # the monitor event is still on its way
            c = self.conns[fd] = Conn(fd, now, now)
        c.delivered += nbytes
        c.messages += 1
        c.last_request = now

    def touch(self, fd: int, now: float) -> None:
        """The broker answered a long poll on ``fd``: that connection was busy, not idle."""
        c = self.conns.get(fd)
        if c is not None:
            c.last_request = now

    def check(self, now: float, busy: set[int]) -> list[tuple[int, str]]:
        """Close what costs too much (``busy``: descriptors with a long poll waiting); returns (fd, why)."""
        self.events(now)
        doomed: dict[int, str] = {}
        for c in self.conns.values():
            received = self._received(c.fd)
            allowance = (
                BASE_ALLOWANCE
                + PER_MESSAGE * c.messages
                + 2 * PER_MESSAGE * (now - c.since) / self.bcfg.zmq_heartbeat_s
            )
            c.held = max(0, received - c.delivered - int(allowance)) if received is not None else 0
            if c.held > self.per_connection:
                doomed[c.fd] = f"holds {c.held} bytes of unfinished frames (over {self.per_connection})"
            elif now - c.last_request > self.bcfg.idle_timeout_s and c.fd not in busy:
                doomed[c.fd] = f"sent no complete request for {now - c.last_request:.0f} s (broker.idle_timeout_s)"
        total = sum(c.held for c in self.conns.values() if c.fd not in doomed)
        self.held = total
        for c in sorted(self.conns.values(), key=lambda c: -c.held):
            if total <= self.bcfg.max_buffered_bytes or c.held == 0:
                break
            if c.fd not in doomed:
                doomed[c.fd] = f"holds {c.held} bytes while all connections hold {total} (broker.max_buffered_bytes)"
                total -= c.held
        alive = [c for c in self.conns.values() if c.fd not in doomed and c.fd not in busy]
        for c in sorted(alive, key=lambda c: c.last_request)[
            : max(0, len(self.conns) - len(doomed) - self.max_connections)
        ]:
            doomed[c.fd] = (
                f"one of the idlest of {len(self.conns)} connections (broker.max_connections={self.max_connections})"
            )
        for fd, why in doomed.items():
            self._close(fd, why)
        return list(doomed.items())

    def _received(self, fd: int) -> int | None:
        if not self.tcp_info:
            return None
        try:
            info = _on_fd(fd, lambda s: s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
        except (OSError, AttributeError):
            return None
        if len(info) < TCPI_BYTES_RECEIVED + 8:  # pragma: no cover - an old kernel: only the idle rules apply
            self.tcp_info = False
            log.warning(
                "TCP_INFO has no tcpi_bytes_received here; unfinished frames are bounded by idle_timeout_s only"
            )
            return None
        return struct.unpack_from("<Q", info, TCPI_BYTES_RECEIVED)[0]

    def _close(self, fd: int, why: str) -> None:
        self.conns.pop(fd, None)
        try:
            _on_fd(fd, lambda s: s.shutdown(socket.SHUT_RDWR))
        except OSError:
            return
        self.counters["connections_closed"] += 1
        log.warning("closed connection fd %d: %s", fd, why)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None


def _on_fd(fd: int, op):
    """``op(socket)`` on libzmq's descriptor itself: no duplicate (there may be no descriptor left to make
    one when they are exhausted), and detached afterwards so that libzmq's descriptor stays open."""
    s = socket.socket(fileno=fd)
    try:
        return op(s)
    finally:
        s.detach()
