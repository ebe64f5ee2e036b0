"""A raw ZMTP 3.0 peer (NULL mechanism) for abuse tests and benchmarks: it can do what a well-behaved
ZeroMQ socket never does — send frames that announce more bytes than follow, multipart messages that
never end, or nothing at all after connecting."""

from __future__ import annotations

import socket
import struct

GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31


def ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def frame(payload: bytes, more: bool = False) -> bytes:
    flags = 0x01 if more else 0x00
    if len(payload) < 256:
        return bytes([flags, len(payload)]) + payload
    return bytes([flags | 0x02]) + struct.pack(">Q", len(payload)) + payload


def frame_header(size: int, more: bool = False) -> bytes:
    """The header of a long frame of ``size`` bytes (send fewer to leave it unfinished)."""
    return bytes([(0x01 if more else 0x00) | 0x02]) + struct.pack(">Q", size)


def connect(address: str, handshake: bool = True, timeout: float = 5.0) -> socket.socket:
    """A TCP connection to ``tcp://host:port``; with ``handshake``, greeted and READY as a DEALER."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    if handshake:
        s.sendall(GREETING)
        got = b""
        while len(got) < 64:
            chunk = s.recv(64 - len(got))
            if not chunk:
                raise ConnectionError("the peer closed during the greeting")
            got += chunk
        s.sendall(ready())
    return s
