"""The range a job's rewards are declared to lie in (issue 31: one rollout pushing in-bounds poison, rewards of
-1e6, tripped the breaker's `reward_drop` rule and stopped the run; the broker now refuses a group whose rewards
lie outside this range, per group, counted per server).

Each reward function's range is its ``rollout.rewards[i].range`` when set, else what the built-in function
declares for its arguments (``math``/``exact``: [0, 1]; ``regex``: [miss, hit]; ``length``: [-(max_penalty +
truncation_penalty), 0] when ``max_penalty`` is set); ``python`` and ``model`` declare none. A sample's reward
is the weighted sum of its parts, a failed part adding 0, so the job's range is the sum over parts of
``[min(0, w*lo, w*hi), max(0, w*lo, w*hi)]``. There is none (the broker falls back to ``broker.max_abs_reward``)
when any part declares none, or when samples may carry rewards no reward function gave: environments other
than ``single_turn`` and ``tool``, and the OpenAI endpoint.
"""

from __future__ import annotations

from fleetrl.common.config.schema import RewardSpec, RolloutConfig

OWN_REWARDS = ("single_turn", "tool")  # environments whose samples are scored by rollout.rewards only


def reward_range(spec: RewardSpec) -> tuple[float, float] | None:
    """The declared range of one reward function's scores (before its weight), or None."""
    if spec.range is not None:
        return float(spec.range[0]), float(spec.range[1])
    a = spec.args
    if spec.name in ("math", "exact"):
        return 0.0, 1.0
    if spec.name in ("regex", "format"):
        hit, miss = float(a.get("hit", 1.0)), float(a.get("miss", 0.0))
        return min(hit, miss), max(hit, miss)
    if spec.name == "length" and a.get("max_penalty") is not None:
        return -(float(a["max_penalty"]) + float(a.get("truncation_penalty", 0.0))), 0.0
    return None


def declared_reward_range(rollout: RolloutConfig) -> tuple[float, float] | None:
    """[low, high] every sample's reward lies in, or None when the job declares none (see the module docstring)."""
    if rollout.env.type not in OWN_REWARDS or rollout.openai.enabled or not rollout.rewards:
        return None
    lo = hi = 0.0
    for spec in rollout.rewards:
        r = reward_range(spec)
        if r is None:
            return None
        a, b = spec.weight * r[0], spec.weight * r[1]
        lo, hi = lo + min(0.0, a, b), hi + max(0.0, a, b)
    return lo, hi
