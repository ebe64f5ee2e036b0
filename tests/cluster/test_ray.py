"""`fleetrl launch ray` against real local Ray clusters: one started with `ray start --head` (joined by
address) and a fresh one the launcher starts itself. The demo task: broker, 2 rollout actors, 1 learner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.common.net import free_port
from tests.cluster.conftest import JOB, evals, events, job_overrides, learned, read_jsonl, trained_ids, wait_for

pytestmark = pytest.mark.cluster
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block`: the process we hold stops the cluster it started when it gets SIGTERM."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("ray is not installed; `pip install -e '.[ray]'` (make test-cluster does it)")
    port = free_port()
    # A throw-away cluster on loopback: no token auth (Ray 2.60 turns it on by default, and its own
    # `ray status` then cannot find the token); the launcher connects either way.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = (tmp_path_factory.mktemp("ray") / "head.out").open("w")
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    address = f"127.0.0.1:{port}"
    status = lambda: (
        subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, env=env).returncode == 0
    )  # noqa: E731
    try:
        wait_for(lambda: head.poll() is not None or status(), 120, "ray start --head")
        assert head.poll() is None, f"ray start --head exited with {head.returncode}"
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()


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


def actor_pid(run: Path, child: str) -> int:
    return [e for e in events(run, child=child, event="started")][-1]["actor_pid"]


def test_job_on_a_head_node_learns_restarts_a_killed_rollout_and_reports_a_killed_learner(ray_head, assets, tmp_path):
    run = tmp_path / "run"
    launch = Launch(run, "--address", ray_head, *job_overrides(assets, "learner.max_minutes=6"))
    try:
        wait_for(lambda: events(run, event="all_ready") or launch.proc.poll() is not None, 180, "all registered", run)
        assert launch.proc.poll() is None, launch.output()
        wait_for(lambda: len(read_jsonl(run / "metrics.jsonl")) >= 10, 120, "10 learner steps", run)

        os.kill(actor_pid(run, "rollout-0"), signal.SIGKILL)  # the rollout actor's process: Ray restarts it
        back = wait_for(lambda: events(run, child="rollout-0", event="rejoined"), 120, "rollout-0 restarted", run)
        assert back and launch.proc.poll() is None
        assert (run / "logs" / "rollout-0" / "attempt-1" / "output.log").exists()

        wait_for(lambda: learned(run), 240, f"held-out accuracy to rise (evals so far: {evals(run)})", run)

        os.kill(actor_pid(run, "learner"), signal.SIGKILL)  # the learner actor: reported, the job fails
        assert launch.wait(180) == 1
        out = launch.output()
        assert "FAILED: learner rank learner died" in out, out[-3000:]
    finally:
        launch.stop()
    ids = trained_ids(run)
    assert ids and len(ids) == len(set(ids)), "a group was trained twice"


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
