"""The objectives a learner trains, one registry keyed by ``algorithm.type``.

Each entry builds, from the learner's set-up, the three things that differ between objectives:

- the **actor**: ``plan(leased) -> batch`` (packed once on the device) and ``step(batch, version)``;
- the **source** of each step's data: batch leases from the broker, or preference pairs from a file;
- the **evaluator** run every ``run.eval_interval`` steps on rank 0 (or None).

plus the models the objective needs (the frozen reference, the PPO critic). ``Learner`` calls
``OBJECTIVES[cfg.algorithm.type](setup)`` once and holds no switch on the objective itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.plugins.registry import Registry
from fleetrl.learner.runtime import Dist


@dataclass
class Setup:
    """What every objective builder gets: the config, the process, the policy engine and a reference loader."""

    cfg: JobConfig
    run_dir: Path
    client: Any  # BrokerClient (None without a fleet)
    dist: Dist
    engine: Any  # the policy's DeepSpeed engine
    dtype: torch.dtype
    generator: torch.Generator
    load_reference: Callable[[], Any]  # the frozen reference model (LoRA: the base with adapters off)
    evaluate_model: Any = None  # learner/evaluate.py's EvaluateModel, handed in by the application (None: no evaluator)
    clock: Any = None  # learner/runtime.py's BudgetClock (the critic's LR follows it too)


@dataclass
class Objective:
    actor: Any  # PolicyActor | DpoActor
    source: Any  # BrokerBatchSource | PreferenceSource
    evaluator: Callable[[torch.nn.Module], dict[str, float]] | None
    critic: Any = None  # learner/critic.py (checkpointed with the policy)


ObjectiveBuilder = Callable[[Setup], Objective]
OBJECTIVES: Registry[ObjectiveBuilder] = Registry("objective", config_key="algorithm.type")


def _eval_due(cfg: JobConfig, dist: Dist) -> bool:
    return dist.is_main and bool(cfg.run.eval_interval)


@OBJECTIVES.register("rl")
def rl(s: Setup) -> Objective:
    """Policy-gradient RL on the fleet's groups: PolicyActor (+ Critic with adv_estimator: gae)."""
    from fleetrl.learner.actor import PolicyActor
    from fleetrl.learner.critic import Critic
    from fleetrl.learner.evaluate import Evaluator
    from fleetrl.learner.source import BrokerBatchSource

    cfg = s.cfg
    ref = s.load_reference() if cfg.algorithm.needs_reference else None
    critic = Critic(cfg, s.dtype, s.dist.device, s.clock) if cfg.algorithm.adv_estimator == "gae" else None
    actor = PolicyActor(s.engine, ref, cfg, s.dist.device, s.generator, critic)
    evaluator = Evaluator(cfg, s.dist.device, s.evaluate_model) if _eval_due(cfg, s.dist) and cfg.data.eval else None
    return Objective(actor, BrokerBatchSource(s.client, cfg, s.dist.rank, s.dist.world), evaluator, critic)


@OBJECTIVES.register("dpo")
def dpo(s: Setup) -> Objective:
    """DPO: offline from data.preference (no fleet), or online from the fleet's groups (best vs worst)."""
    from fleetrl.learner.dpo import DpoActor
    from fleetrl.learner.evaluate import Evaluator
    from fleetrl.learner.preference import PreferenceEvaluator, PreferenceSource
    from fleetrl.learner.source import BrokerBatchSource

    cfg = s.cfg
    ref = s.load_reference() if cfg.algorithm.needs_reference else None
    offline = not cfg.needs_fleet
    actor = DpoActor(s.engine, ref, cfg, s.dist.device, offline=offline)
    source = (
        PreferenceSource(cfg, s.dist.rank, s.dist.world)
        if offline
        else BrokerBatchSource(s.client, cfg, s.dist.rank, s.dist.world)
    )
    evaluator = Evaluator(cfg, s.dist.device, s.evaluate_model) if _eval_due(cfg, s.dist) and cfg.data.eval else None
    if _eval_due(cfg, s.dist) and cfg.data.preference_eval:
        evaluator = PreferenceEvaluator(cfg, ref, s.dist.device, then=evaluator)
    return Objective(actor, source, evaluator)
