"""`fleetrl run --resume RUN_DIR` from another working directory (issue 30, item 8): the saved config keeps what
the first run found from its own directory — relative model and data paths, and a reward named as a module of
that directory (`myproj_30.rw:score`), which is not installed and not on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.e2e.conftest import TINY, read_jsonl

CLI = [sys.executable, "-m", "fleetrl.app.cli"]


def run_cli(args: list[str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the working directory finds myproj_30
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_resume_from_another_directory_finds_the_model_data_and_a_module_reward(tmp_path, tiny_model_dir, arith_data):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "myproj_30").mkdir(parents=True)
    (project / "myproj_30" / "__init__.py").write_text("")
    (project / "myproj_30" / "rw.py").write_text(
        "def score(response: str) -> float:\n    return float('1' in response)\n"
    )
    (project / "models").mkdir()
    (project / "models" / "tiny").symlink_to(tiny_model_dir)
    (project / "data").mkdir()
    (project / "data" / "arith.jsonl").symlink_to(arith_data)
    (project / "job.yaml").write_text("{}\n")
    elsewhere.mkdir()
    run_dir = tmp_path / "run"
    job = [
        *TINY,
        "model.path=models/tiny",
        "data.train=data/arith.jsonl",
        "checkpoint.interval=2",
        "rollout.rewards=[{name: python, args: {function: 'myproj_30.rw:score'}}]",
    ]
    first = run_cli(
        ["run", "--config", "job.yaml", "--run-dir", str(run_dir), "--no-status", *job, "learner.total_steps=2"],
        cwd=project,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == str(Path(tiny_model_dir).resolve())  # `fleetrl run`'s own config.yaml too
    assert saved["run"]["python_path"] == [str(project.resolve())]

    resumed = run_cli(["run", "--resume", str(run_dir), "--no-status", "learner.total_steps=4"], cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
