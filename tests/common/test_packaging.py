"""Every code folder with an __init__.py is listed in pyproject's packages (a wheel would miss it)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_and_mapped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, mapping = set(project["packages"]), project["package-dir"]
    found = set()
    for top in ("common", "broker", "rollout", "learner", "app"):
        assert mapping[f"fleetrl.{top}"] == top
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix().replace("/", ".")
            found.add("fleetrl." + rel)
    assert found == listed, f"missing from pyproject: {found - listed}; listed but absent: {listed - found}"
