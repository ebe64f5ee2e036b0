"""`fleetrl launch ray` on a fresh local Ray cluster the launcher starts itself (the demo task: broker, 2 rollout
actors, 1 learner). A cluster joined by address — head and workers on three hosts, a killed rollout restarted,
`--add-rollout`, a killed learner reported — is tests/cluster/test_hosts_ray.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import JOB, events, job_overrides, read_jsonl

pytestmark = pytest.mark.cluster


class Launch:
    """`fleetrl launch ray` as a child process in its own session."""

    def __init__(self, run: Path, *args: str):
        run.mkdir(parents=True, exist_ok=True)
        self.out_path = run.parent / "launch.out"
        self.out = self.out_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetrl.app.cli", "launch", "ray", "--config", JOB, "--run-dir", str(run), *args],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return self.out_path.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"fleetrl launch ray still running after {timeout:.0f} s:\n{self.output()[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def test_a_fresh_local_cluster_runs_the_job_to_the_end(assets, tmp_path):
    run = tmp_path / "run"
    launch = Launch(
        run, *job_overrides(assets, "cluster.ray.num_cpus=4", "learner.total_steps=15", "run.eval_interval=0")
    )
    try:
        assert launch.wait(300) == 0, launch.output()[-3000:]
    finally:
        launch.stop()
    assert "on a local Ray" in launch.output() and "the learner finished" in launch.output()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 16))
    assert events(run, event="all_ready")
