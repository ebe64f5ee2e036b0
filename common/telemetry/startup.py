"""Where one process's start-up went: named phases from its exec to ready, logged as one line.

Each component marks the end of each phase (``STARTUP.mark("model")``) and logs ``STARTUP.line()`` when it
reports ready, e.g. ``start-up: ready 3.41 s after exec (python+imports 1.92, model 0.31, deepspeed 0.84,
broker 0.34)``. The first phase runs from the process's exec (read from /proc, so the interpreter's own
start and the module imports count) to the first mark. ``benchmarks/startup.py`` reads these lines from a
run's logs to show where `fleetrl run`'s start-up goes.
"""

from __future__ import annotations

import os
import time

LINE_PREFIX = "start-up: ready"  # what benchmarks/startup.py looks for in the logs


def exec_time() -> float:
    """When this process was started, as ``time.time()`` (10 ms resolution, from /proc); now where /proc
    cannot tell (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (ticks after boot)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Startup:
    """The phases of one process's start-up, each as the seconds since the previous mark."""

    def __init__(self, start: float | None = None):
        self.start = exec_time() if start is None else start
        self.last = self.start
        self.phases: dict[str, float] = {}  # in the order they first ended; a phase marked again adds up

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began at the previous mark, or at exec)."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.2f}" for name, s in self.phases.items())
        return f"{LINE_PREFIX} {max(0.0, time.time() - self.start):.2f} s after exec ({parts})"


STARTUP = Startup()  # this process's
