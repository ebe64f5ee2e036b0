"""The CPU meter every figure is taken with: the machine's busy CPU seconds and the share of the machine
that processes other than ours used meanwhile (``others_cpu_share``: ~0 on a quiet box, 0.5 when others kept
half the cores busy). ``fleetrl run`` (``app/launch/cpu.py``) and the benchmarks use it; a speed figure counts
only when that share is low."""

from __future__ import annotations

import os

import psutil

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")  # guest time is already inside user on Linux


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot (all cores)."""
    t = psutil.cpu_times()._asdict()
    return sum(t.get(k, 0.0) for k in BUSY_FIELDS)


def others_cpu_share(machine_busy_delta_s: float, ours_s: float, wall_s: float, cores: int | None = None) -> float:
    """The share of the machine (0..1) others used over ``wall_s``: busy CPU seconds that were not ours, over
    the machine's capacity (wall x cores)."""
    cores = cores or os.cpu_count() or 1
    return max(0.0, machine_busy_delta_s - ours_s) / max(wall_s * cores, 1e-9)
