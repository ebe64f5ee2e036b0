"""The LR schedule counts learner steps, whatever the number of optimizer steps each one takes."""

from __future__ import annotations

import pytest

from fleetrl.common.config import load_config
from fleetrl.learner.runtime import lr_lambda


def schedule(*overrides: str) -> list[float]:
    cfg = load_config(
        None,
        [
            "learner.total_steps=10",
            "learner.warmup_steps=2",
            "learner.lr_schedule=linear",
            "learner.min_lr_ratio=0.0",
            *overrides,
        ],
    )
    per = cfg.algorithm.optimizer_steps(cfg.learner)
    factor = lr_lambda(cfg)
    return [factor(step * per) for step in range(11)]  # the multiplier at the start of each learner step


def test_warmup_then_linear_decay_to_zero_at_total_steps():
    lrs = schedule()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[6] == pytest.approx(0.5) and lrs[10] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "overrides", [["learner.ppo_epochs=2", "learner.mini_batches=4"], ["algorithm.type=dpo", "learner.ppo_epochs=3"]]
)
def test_several_optimizer_steps_per_learner_step_keep_the_same_schedule(overrides):
    assert schedule(*overrides) == pytest.approx(schedule())


def test_optimizer_steps_inside_one_learner_step_share_its_lr():
    cfg = load_config(
        None,
        [
            "learner.total_steps=10",
            "learner.lr_schedule=linear",
            "learner.ppo_epochs=2",
            "learner.mini_batches=2",
            "learner.min_lr_ratio=0.0",
        ],
    )
    factor = lr_lambda(cfg)
    assert factor(4) == factor(5) == factor(7) == pytest.approx(0.9) and factor(8) == pytest.approx(0.8)


def test_optimizer_steps_per_learner_step():
    assert (
        load_config(None, ["learner.ppo_epochs=2", "learner.mini_batches=4"]).algorithm.optimizer_steps(
            load_config(None, ["learner.ppo_epochs=2", "learner.mini_batches=4"]).learner
        )
        == 8
    )
    dpo = load_config(None, ["algorithm.type=dpo", "learner.ppo_epochs=3"])
    assert dpo.algorithm.optimizer_steps(dpo.learner) == 1
