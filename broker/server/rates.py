"""Rates the broker reports in its status: events per second over a sliding window, and the socket
broker's bytes in and out with its process's resources (``broker/...``, ``resource/broker/*``)."""

from __future__ import annotations

from collections import deque

from fleetrl.common.telemetry.resources import ProcessResources


class Rate:
    """Events per second over a sliding window of one-second buckets."""

    def __init__(self, window_s: int = 10):
        self.window_s = window_s
        self.buckets: deque[list[float]] = deque()

    def add(self, now: float, n: int = 1) -> None:
        sec = int(now)
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([sec, n])
        while self.buckets and self.buckets[0][0] <= sec - self.window_s:
            self.buckets.popleft()

    def per_s(self, now: float) -> float:
        horizon = int(now) - self.window_s
        return sum(n for s, n in self.buckets if s > horizon) / self.window_s


class WireStats:
    """Bytes the broker received and sent (request payloads; replies and announcements), and its process."""

    def __init__(self) -> None:
        self.bytes_in = self.bytes_out = 0
        self.rate_in, self.rate_out = Rate(), Rate()
        self.resources = ProcessResources("resource/broker")

    def received(self, n: int, now: float) -> None:
        self.bytes_in += n
        self.rate_in.add(now, n)

    def sent(self, n: int, now: float) -> None:
        self.bytes_out += n
        self.rate_out.add(now, n)

    def stats(self, now: float) -> dict[str, float]:
        return {
            "broker/bytes_in": float(self.bytes_in),
            "broker/bytes_out": float(self.bytes_out),
            "broker/bytes_in_per_s": self.rate_in.per_s(now),
            "broker/bytes_out_per_s": self.rate_out.per_s(now),
            **self.resources.sample(),
        }
