"""`fleetrl launch ray` without a cluster: a missing Ray says what to install; --dry-run starts nothing.
(The launcher itself runs against real local Ray clusters in tests/cluster/test_ray.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.app.launch.ray_job import import_ray
from fleetrl.common.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_missing_ray_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fleetrl\[ray\]'"):
        import_ray()


def test_dry_run_checks_placement_and_starts_nothing(tmp_path):
    base = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "launch",
        "ray",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--run-dir",
        str(tmp_path),
        "--dry-run",
    ]
    out = subprocess.run([*base, "cluster.rollout.servers_per_node=3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "3 rollout actor(s)" in out.stdout and "nothing started" in out.stdout
    assert (tmp_path / "config.yaml").exists()
    bad = subprocess.run([*base, "learner.num_ranks=2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "learner.num_ranks=2" in bad.stderr
