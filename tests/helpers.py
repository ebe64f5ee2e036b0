"""Helpers shared by tests: sample groups, configs, and broker processes started (and stopped) by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

from fleetrl.common import messages as m


def make_group(
    prompt_id: str, version: int = 0, n: int = 2, t: int = 4, rewards=None, gid: str | None = None, token: int = 5
) -> m.SampleGroup:
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    return m.build_group(
        gid or uuid.uuid4().hex,
        prompt_id,
        version,
        [1, 2, 3],
        [(np.full(t, token), -np.ones(t)) for _ in rewards],
        rewards,
    )


def write_job(tmp_path: Path, data_path: str, **sections) -> Path:
    """A job YAML with the given sections merged over a small default."""
    job = {"data": {"train": data_path}, "broker": {"port": 0, "pub_port": 0}}
    for key, value in sections.items():
        job.setdefault(key, {}).update(value)
    path = tmp_path / f"job-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


class BrokerProcess:
    """`fleetrl broker` as a child process; stopped by its own PID only."""

    def __init__(self, config: Path, run_dir: Path, *overrides: str, limits: dict | None = None):
        """``limits``: resource limits of the broker process, e.g. {resource.RLIMIT_NOFILE: (1024, 1024)}."""
        self.config, self.run_dir, self.overrides, self.limits = config, run_dir, overrides, limits or {}
        self.proc: subprocess.Popen | None = None
        self.endpoint: dict = {}

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        ep = self.run_dir / "broker.json"
        ep.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.run_dir / "broker.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetrl.app.cli",
                "broker",
                "--config",
                str(self.config),
                "--run-dir",
                str(self.run_dir),
                *self.overrides,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=self._apply_limits if self.limits else None,
        )
        deadline = time.monotonic() + timeout
        while not ep.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {(self.run_dir / 'broker.log').read_text()[-3000:]}")
            time.sleep(0.05)
        self.endpoint = json.loads(ep.read_text())
        return self

    def _apply_limits(self) -> None:
        import resource

        for which, value in self.limits.items():
            resource.setrlimit(which, value)

    @property
    def address(self) -> str:
        return self.endpoint["address"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()
        return self.proc.returncode if self.proc else None
