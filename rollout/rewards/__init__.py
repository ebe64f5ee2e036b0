"""Reward functions behind one registry, combined with weights by ``RewardScorer`` (docs/rewards.md).

``math``, ``exact``, ``regex`` (alias ``format``), ``length``, ``python`` (a user function) and
``model`` (a local reward model). Importing this package is light: math-verify, torch and
transformers load only when a reward that needs them is built.
"""

from fleetrl.rollout.rewards import builtin, model, python  # noqa: F401  (register the rewards)
from fleetrl.rollout.rewards.base import (
    REWARDS,
    Reward,
    RewardArgs,
    RewardArgsError,
    RewardInput,
    RewardResult,
    SampleReward,
    register_reward,
)
from fleetrl.rollout.rewards.runner import CallTimeout
from fleetrl.rollout.rewards.scorer import RewardScorer, check_rewards

__all__ = [
    "REWARDS",
    "CallTimeout",
    "Reward",
    "RewardArgs",
    "RewardArgsError",
    "RewardInput",
    "RewardResult",
    "RewardScorer",
    "SampleReward",
    "check_rewards",
    "register_reward",
]
