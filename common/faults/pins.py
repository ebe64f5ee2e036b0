"""Pinned states for chaos runs: a process stops at a named point, so that a controller kills it exactly
there (NeMo-RL's pinned-state chaos scripts; ``benchmarks/chaos.py`` drives it).

    FLEETRL_PIN=rollout.broadcast FLEETRL_PIN_DIR=/tmp/pins [FLEETRL_PIN_AFTER=3] fleetrl run ...

Production code passes the points through ``faults.at(point)`` (``points.py``); ``pin(point)`` costs one set
lookup unless ``FLEETRL_PIN`` (a comma list) names the point. Once the
controller has *armed* it (created ``<dir>/<point>.armed``, e.g. after the learner's 4th step), the
``FLEETRL_PIN_AFTER``-th time a process passes it, the first process to get there writes
``<dir>/<point>.pinned`` (its pid) and waits; the controller kills it and writes ``<dir>/<point>.done``,
so the restarted process (same environment) passes through. Points: ``rollout.idle``,
``rollout.generate``, ``rollout.broadcast``, ``broker.spool_write``, ``learner.step``, ``learner.publish``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

POINTS = frozenset(p for p in os.environ.get("FLEETRL_PIN", "").split(",") if p)
_hits: Counter[str] = Counter()


def pin(point: str) -> None:
    if point not in POINTS:
        return
    root = Path(os.environ.get("FLEETRL_PIN_DIR", "."))
    done = root / f"{point}.done"
    if done.exists() or not (root / f"{point}.armed").exists():
        return
    _hits[point] += 1
    if _hits[point] < int(os.environ.get("FLEETRL_PIN_AFTER", "1")):
        return
    try:
        fd = os.open(root / f"{point}.pinned", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process of this role got there first: it is the one pinned
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while not done.exists():  # until killed (or released by the controller writing the .done file)
        time.sleep(0.02)
