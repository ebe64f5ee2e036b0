"""The verifiers lane (`make test-verifiers`, its own .venv-verifiers): every test here needs verifiers 0.4.0 and
carries the `verifiers` marker; `make test` leaves the folder out. The local taskset `fleet_arith` (this folder)
is importable by its taskset id."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))

try:
    import verifiers.v1  # noqa: F401
except ImportError:  # a plain `pytest` in .venv: these tests need .venv-verifiers (in the lane, pytest then
    collect_ignore_glob = ["test_*.py"]  # finds no test and exits 5, so `make test-verifiers` still fails loudly)


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.verifiers)
