from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TINY = [
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "rollout.max_new_tokens=4",
    "rollout.rewards=[{name: exact}]",
    "learner.groups_per_step=4",
    "learner.total_steps=3",
    "learner.lr=1e-3",
    "sync.transport=filesystem",
    "checkpoint.interval=2",
    "broker.max_staleness=1",
    "run.ready_timeout_s=240",
    "rollout.device=cpu",
    "learner.device=cpu",
]


def job_args(tiny_model_dir: str, arith_data: str, *extra: str) -> list[str]:
    return [f"model.path={tiny_model_dir}", f"data.train={arith_data}", *TINY, *extra]


class RunProcess:
    """`fleetrl run` as a child process (its own session, so a SIGINT reaches only it)."""

    def __init__(self, run_dir: Path, config: str, overrides: list[str]):
        self.run_dir = run_dir
        self.out = (run_dir.parent / f"{run_dir.name}.out").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetrl.app.cli",
                "run",
                "--config",
                config,
                "--run-dir",
                str(run_dir),
                "--no-status",
                *overrides,
            ],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.out.flush()

    def output(self) -> str:
        self.out.flush()
        return (self.run_dir.parent / f"{self.run_dir.name}.out").read_text()

    def child_pids(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


@pytest.fixture
def empty_config(tmp_path) -> str:
    path = tmp_path / "job.yaml"
    path.write_text("{}\n")
    return str(path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
