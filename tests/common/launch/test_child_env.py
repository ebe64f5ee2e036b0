"""What every child of a job (`fleetrl run`, the Slurm and Ray launchers) runs with."""

from __future__ import annotations

import subprocess
import sys

from fleetrl.common.launch.run import child_env

BARS = "from tqdm import tqdm\nfor _ in tqdm(range(3), desc='bars'):\n    pass\nprint('ok')\n"


def test_children_write_no_progress_bars_into_their_logs():
    env = child_env(2)
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    out = subprocess.run([sys.executable, "-c", BARS], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "ok\n" and "bars" not in out.stderr, out.stderr
    shown = subprocess.run([sys.executable, "-c", BARS], capture_output=True, text=True, check=True,
                           env={k: v for k, v in env.items() if k != "TQDM_DISABLE"})
    assert "bars" in shown.stderr  # without it the bar is drawn (the check can fail)
