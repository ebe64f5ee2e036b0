"""The learner's metric monitor: one call per step fans a flat metric dict out to every sink.

``metrics.jsonl`` in the run directory is always written (one JSON object per step, with ``step``
and ``time``); the console, TensorBoard, wandb and Prometheus sinks (``learner/sinks.py``, turned on
in the ``telemetry`` section) plug in through the same ``Sink`` interface. Each row also gets this
process's resource metrics (``resource/learner/*``, ``common/resources.py``).
"""

from __future__ import annotations

from pathlib import Path

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.resources import ProcessResources
from fleetrl.learner.sinks import ConsoleSink, JsonlSink, Sink, make_sinks

__all__ = ["ConsoleSink", "JsonlSink", "Monitor", "Sink"]


class Monitor:
    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self.history: list[dict[str, float]] = []
        # this process's CPU, RSS and GPU (resource/learner/*) beside every row, where there are sinks
        self.resources = ProcessResources("resource/learner") if sinks else None

    @classmethod
    def for_run(cls, run_dir: Path, rank: int, console_every: int = 1, cfg: JobConfig | None = None) -> "Monitor":
        """The sinks ``cfg.telemetry`` asks for on rank 0 (JSONL and console at least), none elsewhere."""
        return cls(make_sinks(cfg, run_dir, rank, console_every))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.resources is not None:
            metrics = {**metrics, **self.resources.sample()}
        self.history.append({"step": step, **metrics})
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
