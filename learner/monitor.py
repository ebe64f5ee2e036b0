"""The learner's metric monitor: one call per step fans a flat metric dict out to every sink.

``metrics.jsonl`` in the run directory is always written (one JSON object per step, with ``step``
and ``time``); the console, TensorBoard, wandb and Prometheus sinks (``learner/sinks.py``, turned on
in the ``telemetry`` section) plug in through the same ``Sink`` interface. Sample completions
(``log_completions``) go to ``completions.jsonl`` and to the sinks that show tables. Each row also
gets this process's resource metrics (``resource/learner/*``, ``common/telemetry/resources.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry.resources import ProcessResources
from fleetrl.learner.sinks import ConsoleSink, JsonlSink, Sink, make_sinks

__all__ = ["ConsoleSink", "JsonlSink", "Monitor", "Sink"]


class Monitor:
    def __init__(self, sinks: list[Sink], completions_path: Path | None = None):
        self.sinks = sinks
        self.completions_path = completions_path
        self.history: list[dict[str, float]] = []
        # this process's CPU, RSS and GPU (resource/learner/*) beside every row, where there are sinks
        self.resources = ProcessResources("resource/learner") if sinks else None

    @classmethod
    def for_run(cls, run_dir: Path, rank: int, console_every: int = 1, cfg: JobConfig | None = None) -> Monitor:
        """The sinks ``cfg.telemetry`` asks for on rank 0 (JSONL and console at least), none elsewhere."""
        return cls(
            make_sinks(cfg, run_dir, rank, console_every), Path(run_dir) / "completions.jsonl" if rank == 0 else None
        )

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions: one JSON line per response in completions.jsonl, and a table in the sinks."""
        if self.completions_path is None or not rows:
            return
        with self.completions_path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for sink in self.sinks:
            sink.write_completions(step, rows)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.resources is not None:
            metrics = {**metrics, **self.resources.sample()}
        self.history.append({"step": step, **metrics})
        for sink in self.sinks:
            sink.write(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
