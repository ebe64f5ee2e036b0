"""The learner's metric monitor: one call per step fans a flat metric dict out to every sink.

``metrics.jsonl`` in the run directory is always written (one JSON object per step, with ``step``
and ``time``); further sinks (TensorBoard, wandb, Prometheus) plug in through the same interface.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger("fleetrl.learner")


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()})
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    """A short log line every ``every`` steps."""

    KEYS = ("reward/mean", "actor/loss", "actor/kl", "actor/entropy", "actor/grad_norm", "off_policy/staleness_mean",
            "throughput/samples_per_s")

    def __init__(self, every: int = 1):
        self.every = every

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.every == 0:
            shown = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in self.KEYS if k in metrics)
            log.info("step %d  %s", step, shown)

    def close(self) -> None:
        pass


class Monitor:
    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.history: list[dict[str, float]] = []

    @classmethod
    def for_run(cls, run_dir: Path, rank: int, console_every: int = 1) -> "Monitor":
        if rank != 0:
            return cls([])
        return cls([JsonlSink(Path(run_dir) / "metrics.jsonl"), ConsoleSink(console_every)])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
