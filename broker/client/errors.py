"""What a broker client raises: the broker did not answer (``BrokerUnavailable``), refused the key
(``BrokerUnauthorized``), or answered with a typed error (``BrokerError``)."""

from __future__ import annotations


class BrokerUnavailable(ConnectionError):
    """The broker did not answer in time (down, unreachable, or refusing this client)."""


class BrokerUnauthorized(BrokerUnavailable):
    """The broker refused this client's CURVE key."""


class BrokerError(RuntimeError):
    """A typed error reply; ``code`` is one of ``messages.ErrorCode``."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code, self.reason = code, reason
