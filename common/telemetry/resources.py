"""Resource metrics of one process: CPU, resident memory and, where a GPU is in use, its utilisation and
this process's GPU memory (docs/monitoring.md, "Resource metrics").

``ProcessResources(prefix).sample()`` returns ``{<prefix>/cpu_percent, <prefix>/rss_mb}`` plus
``<prefix>/gpu_util_percent`` and ``<prefix>/gpu_mem_mb`` when NVML (``nvidia-ml-py``, imported
lazily) sees this process on a GPU. Without NVML, without a GPU, or for a process that holds no GPU
context, the GPU keys are **omitted**, never reported as zeros. ``cpu_percent`` is the process's CPU
time over wall time since the previous sample (100 = one core busy); samples closer together than
``min_interval_s`` return the previous values, so several threads may ask.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import psutil

log = logging.getLogger("fleetrl.resources")

MB = 1 << 20


class Nvml:
    """This process's GPUs through NVML; ``Nvml.open()`` is None when NVML is not there."""

    def __init__(self, nvml: Any, pid: int):
        self.nvml, self.pid = nvml, pid
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    @classmethod
    def open(cls, pid: int | None = None) -> Nvml | None:
        try:
            import pynvml  # the nvidia-ml-py package

            pynvml.nvmlInit()
            return cls(pynvml, pid or os.getpid())
        except Exception as e:  # noqa: BLE001 - ImportError, or NVMLError without a driver: no GPU metrics
            log.debug("no GPU metrics (NVML unavailable: %s)", e)
            return None

    def sample(self, prefix: str) -> dict[str, float]:
        """Utilisation (mean over the GPUs this process uses) and this process's memory on them (sum)."""
        util, mem, used = 0.0, 0.0, 0
        for handle in self.handles:
            procs = list(self.nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            mine = [p for p in procs if p.pid == self.pid]
            if not mine:
                continue
            used += 1
            util += float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            mem += sum(float(p.usedGpuMemory or 0) for p in mine) / MB
        if not used:
            return {}
        return {f"{prefix}/gpu_util_percent": util / used, f"{prefix}/gpu_mem_mb": mem}


class ProcessResources:
    def __init__(self, prefix: str, min_interval_s: float = 1.0, nvml: Nvml | None | bool = True):
        self.prefix, self.min_interval_s = prefix, min_interval_s
        self.proc = psutil.Process()
        self.nvml = Nvml.open() if nvml is True else (nvml or None)
        self._lock = threading.Lock()
        self._last = (time.monotonic(), self._cpu_s())
        self._values: dict[str, float] = {}
        self._at = float("-inf")

    def _cpu_s(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def sample(self) -> dict[str, float]:
        with self._lock:
            now = time.monotonic()
            if now - self._at < self.min_interval_s:
                return dict(self._values)
            (t0, cpu0), cpu = self._last, self._cpu_s()
            self._last, self._at = (now, cpu), now
            values = {
                f"{self.prefix}/cpu_percent": 100.0 * (cpu - cpu0) / max(now - t0, 1e-6),
                f"{self.prefix}/rss_mb": self.proc.memory_info().rss / MB,
            }
            if self.nvml is not None:
                try:
                    values.update(self.nvml.sample(self.prefix))
                except Exception as e:  # noqa: BLE001 - a driver hiccup costs the GPU keys of this sample only
                    log.debug("NVML sample failed: %s", e)
            self._values = values
            return dict(values)
