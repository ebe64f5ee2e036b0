"""`fleetrl run`'s CPU meter: cores busy per child over the RL phase, from the children's process trees."""

from __future__ import annotations

import subprocess
import sys
import time

from fleetrl.app.launch.cpu import CpuMeter

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
SPIN_IN_CHILD = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', {code!r}])\n"


def test_a_busy_child_and_an_idle_one_are_told_apart_and_a_grandchild_counts_for_its_parent(tmp_path):
    busy = subprocess.Popen(
        [sys.executable, "-c", SPIN_IN_CHILD.format(code=SPIN.format(s=1.2))]
    )  # the work is a grandchild
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        meter = CpuMeter()
        meter.begin({"busy": busy.pid, "idle": idle.pid})
        deadline = time.monotonic() + 10
        while busy.poll() is None and time.monotonic() < deadline:
            meter.sample({n: p.pid for n, p in (("busy", busy), ("idle", idle)) if p.poll() is None})
            time.sleep(0.05)
        result = meter.result()
    finally:
        busy.wait(timeout=10), idle.wait(timeout=10)
    cpu_s = {k: v * result["wall_s"] for k, v in result["per_child"].items()}  # CPU seconds (load-independent)
    assert 0.9 < cpu_s["busy"] < 1.6, result  # the grandchild's 1.2 CPU s, less the last sample interval
    assert cpu_s["idle"] < 0.3, result
    assert result["cores_busy"] == sum(result["per_child"].values())
    assert "of" in meter.line(result) and "busy" in meter.line(result)
    CpuMeter.save(result, tmp_path)
    assert (tmp_path / "cpu.json").exists()


def test_a_child_that_is_gone_keeps_its_last_reading():
    meter = CpuMeter()
    meter.begin({})
    meter.sample({"ghost": 2**22 + 12345})  # no such process: nothing read, nothing raised
    assert meter.result()["per_child"] == {} and meter.result()["cores_busy"] == 0
