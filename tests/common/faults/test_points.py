"""The fault seam (common/faults/points.py): named points, one registry, no-ops unless a fault is planned, and
the only way production code reaches the faults and pins."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from fleetrl.common import faults
from fleetrl.common.faults import plan
from fleetrl.common.faults.plan import FaultPlan
from fleetrl.common.faults.points import POINTS
from fleetrl.common.plugins.registry import RegistryError

ROOT = Path(__file__).resolve().parents[3]
SEAM_POINTS = {
    "rollout.idle",
    "rollout.generate",
    "rollout.broadcast",
    "learner.step",
    "learner.publish",
    "broker.spool_write",
    "rollout.sampling",
    "rollout.scores",
    "rollout.weight_load",
    "rollout.version_loaded",
    "learner.update",
}


@pytest.fixture
def planned():
    def use(**kwargs):
        plan.set_plan(FaultPlan(**kwargs))

    yield use
    plan.set_plan(FaultPlan())


@dataclasses.dataclass(frozen=True)
class Params:
    temperature: float = 1.0


def test_every_point_is_registered_once():
    assert set(POINTS.names()) == SEAM_POINTS


def test_nothing_planned_every_point_passes_its_value_through_untouched():
    params, scores, load = Params(), [[0.0, 1.0]], (lambda engine: 3)
    assert faults.at("rollout.sampling", params, version=5) is params
    assert faults.at("rollout.scores", scores, responses=["", "1"], nan_score=float) is scores and scores == [
        [0.0, 1.0]
    ]
    assert faults.at("rollout.weight_load", load, pending=lambda: 3, owner=object()) is load
    assert faults.at("rollout.idle") is None
    assert isinstance(faults.around("learner.update", learner=None, step=1), contextlib.nullcontext)


def test_a_planned_fault_acts_at_its_point(planned):
    planned(kinds=frozenset({"entropy_collapse", "reward_hack"}), at=4, duration=2)
    assert faults.at("rollout.sampling", Params(), version=3).temperature == 1.0  # before the window
    assert faults.at("rollout.sampling", Params(), version=4).temperature == 0.1
    scores = [[0.0, 0.0]]
    faults.at("rollout.version_loaded", 5)  # the rollout's fault clock
    faults.at("rollout.scores", scores, responses=["", "42"], nan_score=float)
    assert scores == [[1.0, 0.0]]  # the degenerate answer is paid


def test_the_learner_update_point_spikes_the_lr_at_its_step(planned):
    planned(kinds=frozenset({"lr_spike"}), at=3)
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = type("L", (), {"optimizer": opt, "scheduler": sched, "module": layer})()
    with faults.around("learner.update", learner=learner, step=2):
        pass
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    with faults.around("learner.update", learner=learner, step=3):
        pass
    assert opt.param_groups[0]["lr"] == pytest.approx(5.0) and sched.base_lrs == [pytest.approx(5.0)]


def test_an_unknown_point_is_named_when_faults_are_on(planned):
    planned(kinds=frozenset({"nan_reward"}), at=1)
    with pytest.raises(RegistryError, match="rollout.sampling"):
        faults.at("rollout.smapling", Params(), version=1)


def test_production_code_reaches_faults_and_pins_only_through_the_seam():
    """No module outside common/faults/ imports plan.py or pins.py: the chaos lines are gone from the code."""
    direct = []
    for top in ("common", "broker", "rollout", "learner", "app"):
        for path in (ROOT / top).rglob("*.py"):
            if path.parent == ROOT / "common" / "faults":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
                module = node.module if isinstance(node, ast.ImportFrom) else ""
                full = [f"{module}.{n}" if module else n for n in names]
                if any(f.startswith(("fleetrl.common.faults.plan", "fleetrl.common.faults.pins")) for f in full):
                    direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert direct == []
