"""What every child of a job (`fleetrl run`, the Slurm and Ray launchers) runs with."""

from __future__ import annotations

import subprocess
import sys

from fleetrl.app.launch.run import child_env

BARS = "from tqdm import tqdm\nfor _ in tqdm(range(3), desc='bars'):\n    pass\nprint('ok')\n"


def test_children_write_no_progress_bars_into_their_logs():
    env = child_env(2)
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    out = subprocess.run([sys.executable, "-c", BARS], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "ok\n" and "bars" not in out.stderr, out.stderr
    shown = subprocess.run(
        [sys.executable, "-c", BARS],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in env.items() if k != "TQDM_DISABLE"},
    )
    assert "bars" in shown.stderr  # without it the bar is drawn (the check can fail)


def test_the_cores_are_split_evenly_by_default_and_the_settings_win(monkeypatch):
    """Issue 24: busy threads never outnumber the cores (2 + 2 on a quiet 2-core box trained 24% slower)."""
    from fleetrl.app.launch.run import thread_plan
    from fleetrl.common.config import load_config

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert thread_plan(load_config(None, [])) == (4, 4)  # one rank, one server: half the cores each
    assert thread_plan(load_config(None, ["learner.num_ranks=2", "rollout.num_servers=2"])) == (2, 2)
    assert thread_plan(load_config(None, ["run.learner_threads=3", "run.rollout_threads=1"])) == (3, 1)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert thread_plan(load_config(None, [])) == (1, 1)
    assert thread_plan(load_config(None, ["rollout.num_servers=4"])) == (1, 1)  # never below one thread
    assert thread_plan(load_config(None, ["rollout.engine=vllm"])) == (1, 1)
