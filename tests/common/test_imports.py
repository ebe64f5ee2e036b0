"""`common/` must import without torch, deepspeed, vllm or transformers (the CLI too)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "deepspeed", "vllm", "transformers")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_config_and_messages_import_light():
    assert _loaded_after("import fleetrl.common.config, fleetrl.common.messages, fleetrl.common.data.tasks") == []


def test_cli_help_imports_light():
    code = "from fleetrl.app.cli import build_parser\nbuild_parser().format_help()"
    assert _loaded_after(code) == []


def test_every_command_has_help():
    from fleetrl.app.cli import COMMANDS

    top = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "--help"], capture_output=True, text=True, check=True
    )
    for name in COMMANDS:
        assert name in top.stdout
        out = subprocess.run([sys.executable, "-m", "fleetrl.app.cli", name, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert "usage: fleetrl " + name in out.stdout


def test_launchers_import_without_torch_or_ray():
    code = (
        "import fleetrl.app.launch.world, fleetrl.app.launch.slurm, fleetrl.app.launch.slurm_job, "
        "fleetrl.app.launch.supervisor, fleetrl.app.launch.k8s, fleetrl.app.launch.ray_job, "
        "fleetrl.common.config.cluster"
    )
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {(*HEAVY, 'ray')!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_weightsync_imports_without_torch():
    """Its torch imports sit inside the functions (and under TYPE_CHECKING for annotations)."""
    assert _loaded_after("import fleetrl.common.weightsync, fleetrl.common.weightsync.groups") == []


def test_every_module_of_common_imports_without_torch():
    """The whole ground floor, weight sync's sender and receiver included: torch only inside functions."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "common"
    names = sorted(
        ".".join(("fleetrl", "common", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for p in root.rglob("*.py")
    )
    assert "fleetrl.common.weightsync.sender.broadcast" in names and len(names) > 40
    assert _loaded_after("import " + ", ".join(names)) == []
