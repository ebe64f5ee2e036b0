"""Network helpers every floor uses."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now ("" = every interface); the caller binds it soon after (a race the
    callers tolerate: a clash fails loudly at their bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
