"""The circuit breaker end to end inside one learner: collapse -> rollback (LR halved) -> go on; or stop."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.learner.runtime import init_distributed
from fleetrl.learner.train import train
from tests.learner.conftest import inproc_client


def scripted_groups(rewards_per_step: list[float], groups_per_step: int = 2, vocab: int = 263) -> list[m.SampleGroup]:
    """Groups in training order; step i's groups have mean reward ``rewards_per_step[i]`` (within-group variance)."""
    rng = np.random.default_rng(0)
    out = []
    for step, mean in enumerate(rewards_per_step):
        for g in range(groups_per_step):
            hi = round(4 * mean)
            rewards = [1.0] * hi + [0.0] * (4 - hi)
            if len(set(rewards)) == 1:
                rewards[0] = 1.0 - rewards[0]
            responses = [(rng.integers(7, vocab, 3), np.full(3, -1.5)) for _ in rewards]
            out.append(
                m.build_group(
                    f"s{step}-{g}", f"0:{step * groups_per_step + g}", 0, rng.integers(7, vocab, 4), responses, rewards
                )
            )
    return out


def job(tiny_model_dir, tmp_path, *overrides):
    rule = "{name: reward_drop, action: rollback, window: 2, threshold: 0.3}"
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "learner.groups_per_step=2",
            "learner.lr=1e-3",
            "sync.transport=filesystem",
            f"run.dir={tmp_path}",
            "checkpoint.interval=2",
            "checkpoint.keep_last=10",
            "sync.keep_versions=100",
            "health.healthy_window=1",
            f"health.rules=[{rule}, {{name: non_finite, action: stop}}]",
            "broker.max_staleness=100",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def dist():
    return init_distributed(load_config(None, ["learner.device=cpu"]))


def events(tmp_path):
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_collapse_rolls_back_halves_lr_and_training_continues(dist, tiny_model_dir, tmp_path):
    # 4 good steps, a collapse for 2 steps, then good again
    script = [0.75] * 4 + [0.0] * 2 + [0.75] * 8
    cfg = job(tiny_model_dir, tmp_path, "learner.total_steps=12", "health.max_rollbacks=2")
    client, broker = inproc_client(scripted_groups(script), "broker.max_staleness=100")
    assert train(cfg, tmp_path, client=client) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 12  # training went on after the rollback
    fired = [e for e in events(tmp_path) if e["rule"] == "reward_drop"]
    rolled = [e for e in events(tmp_path) if e["rule"] == "rollback"]
    assert fired and fired[0]["action"] == "rollback" and fired[0]["step"] >= 5
    assert len(rolled) == 1 and "healthy checkpoint at step 4" in rolled[0]["message"]
    after = [r for r in rows if r["step"] > rolled[0]["step"]]
    assert after[0]["actor/lr"] == pytest.approx(0.5e-3)  # lr x health.lr_factor
    assert rows[-1]["health/rollbacks"] == 1
    # the fleet was paused, the bad versions discarded, then resumed; the restored weights were published
    assert broker.state.paused is False and broker.state.discarded_versions
    # the weights published at the rollback are exactly the healthy step-4 checkpoint's
    rollback_version = int(after[0]["policy/version"]) - 1  # the step after it published one more
    restored = load_file(tmp_path / "weights" / f"v{rollback_version}" / "model.safetensors")
    healthy = load_file(tmp_path / "checkpoints" / "step-00000004" / "hf" / "model.safetensors")
    assert all((restored[k] == healthy[k]).all() for k in healthy)


def test_permanent_collapse_stops_after_max_rollbacks(dist, tiny_model_dir, tmp_path):
    script = [0.75] * 4 + [0.0] * 30
    cfg = job(tiny_model_dir, tmp_path, "learner.total_steps=30", "health.max_rollbacks=1")
    client, _ = inproc_client(scripted_groups(script), "broker.max_staleness=100")
    assert train(cfg, tmp_path, client=client) == 3  # non-zero: the circuit breaker stopped the run
    rules = [e["rule"] for e in events(tmp_path)]
    assert rules.count("rollback") == 1 and rules.count("reward_drop") >= 2


def test_nan_loss_triggers_the_non_finite_rule(dist, tiny_model_dir, tmp_path, monkeypatch):
    from fleetrl.learner.actor import PolicyActor as Actor
    from fleetrl.learner.algorithms import LossOutputs

    cfg = job(tiny_model_dir, tmp_path, "learner.total_steps=5")
    client, _ = inproc_client(scripted_groups([0.5] * 5), "broker.max_staleness=100")
    original_init, calls = Actor.__init__, []

    def init(self, *args, **kwargs):  # the policy loss turns NaN on the second step
        original_init(self, *args, **kwargs)
        real = self.loss_fn

        def loss_fn(inp, alg):
            out = real(inp, alg)
            calls.append(1)
            return LossOutputs(out.loss * float("nan"), out.metrics) if len(calls) == 2 else out

        self.loss_fn = loss_fn

    monkeypatch.setattr(Actor, "__init__", init)
    assert train(cfg, tmp_path, client=client) == 3
    (nan,) = [e for e in events(tmp_path) if e["rule"] == "non_finite"]
    assert nan["step"] == 2 and nan["action"] == "stop"
