"""run.file_access: the umask every fleetrl process of a job runs with (owner-only by default)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetrl.common.config import ConfigError, load_config

PROBE = (
    "import os, sys\nfrom fleetrl.app.cli import main\nmain(sys.argv[1:])\n"
    "print('umask', oct(os.umask(0)), file=sys.stderr)\n"
)


def umask_after(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True)
    return [line for line in out.stderr.splitlines() if line.startswith("umask ")][-1].split()[1]


def test_the_job_file_or_an_override_sets_the_umask(tmp_path):
    assert umask_after("config", "show") == "0o77"
    assert umask_after("config", "show", "run.file_access=group") == "0o27"
    job = tmp_path / "job.yaml"
    job.write_text("run: {file_access: all}\n")
    assert umask_after("config", "show", "-c", str(job)) == "0o22"
    run = tmp_path / "run"  # a resumed run reads its own config.yaml
    run.mkdir()
    (run / "config.yaml").write_text("run: {file_access: group}\n")
    assert umask_after("run", "--resume", str(run), "--no-status") == "0o27"  # refused (no checkpoint), umask set


def test_a_bad_value_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="run.file_access.*'everyone'.*owner, group, all"):
        load_config(None, ["run.file_access=everyone"])
