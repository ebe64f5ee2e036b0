"""How busy a job kept the machine: CPU seconds of every process `fleetrl run` started, over the RL phase.

`fleetrl run` samples its children's process trees (torchrun's workers included) once a second and keeps
each process's last reading, so a process that exits before the summary still counts up to its last
sample (one that exits before its first sample, e.g. the learner of a run shorter than a second, counts 0); the
children still running are read once more at the end. The summary line and ``<run-dir>/cpu.json`` give cores busy (CPU seconds / wall seconds) in all
and per child, and the share of the machine that other processes used meanwhile (a figure measured
while that share is high says little about the job).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil

from fleetrl.common.telemetry.cpu import machine_busy_s, others_cpu_share


class CpuMeter:
    def __init__(self) -> None:
        self.last: dict[int, tuple[str, float]] = {}  # pid -> (child name, CPU seconds at the last sample)
        self.start: dict[str, float] | None = None
        self.t0 = self.machine0 = 0.0

    def sample(self, children: dict[str, int]) -> None:
        """One reading of each child's process tree (``children``: name -> pid of a live child)."""
        for name, pid in children.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                self.last[p.pid] = (name, t.user + t.system)

    def per_child(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, cpu in self.last.values():
            out[name] = out.get(name, 0.0) + cpu
        return out

    def begin(self, children: dict[str, int]) -> None:
        """The RL phase starts: everything so far (imports, model loading) is left out."""
        self.sample(children)
        self.start, self.t0, self.machine0 = self.per_child(), time.monotonic(), machine_busy_s()

    def result(self) -> dict:
        wall = max(time.monotonic() - self.t0, 1e-9)
        start = self.start or {}
        per = {k: (v - start.get(k, 0.0)) / wall for k, v in sorted(self.per_child().items())}
        cores = os.cpu_count() or 1
        job = sum(per.values())
        others = others_cpu_share(machine_busy_s() - self.machine0, job * wall, wall, cores)
        return {"wall_s": wall, "cores": cores, "cores_busy": job, "per_child": per, "others_cpu_share": others}

    def line(self, result: dict) -> str:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in result["per_child"].items())
        return (
            f"fleetrl run: CPU during RL {result['cores_busy']:.2f} of {result['cores']} cores ({parts}); "
            f"other processes used {100 * result['others_cpu_share']:.0f}% of the machine"
        )

    @staticmethod
    def save(result: dict, run_dir: Path) -> None:
        (run_dir / "cpu.json").write_text(json.dumps(result, indent=1))
