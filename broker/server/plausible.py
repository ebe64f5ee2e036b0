"""Plausibility at ingest, per group, counted per server (issue 31).

Decoding and ``messages.check_group`` refuse what is impossible (NaN, inf, a positive log-prob, a token
outside the vocabulary). What is possible but implausible got through and tripped the learner's breaker:
one rollout pushing rewards of -1e6 (44 groups) or behaviour log-probs of 0.0 (60 groups) made
``reward_drop`` / ``mismatch_kl_ceiling`` roll back three times and stop the run. Here a group is
refused, with a reason and a code, when

- a reward (or its ReMax ``baseline_reward``) lies outside the job's declared range
  (``common.config.rewards``), or, when the job declares none, beyond ``broker.max_abs_reward``
  (code ``implausible_reward``);
- at ``rollout.temperature > 0``, ``broker.max_zero_logprob_fraction`` or more of its sampled tokens (loss
  mask 1, at least ``ZERO_MIN_TOKENS``) have a behaviour log-prob of exactly 0.0 (``implausible_logprob``).
  One exact 0.0 is honest: float32 rounds the log-prob of a token of probability above 1 - 6e-8 to it,
  and confident models sample such tokens; a group made of them at temperature > 0 is not.

The broker counts each refusal against the pushing client id (``Status.clients[i].counters``, kept across
its re-registrations) and in ``Status.counters["implausible/<kind>"]``, so health rules can act on the one
server (issue 27) instead of rolling back the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetrl.common import messages as m
from fleetrl.common.config.rewards import declared_reward_range
from fleetrl.common.config.schema import JobConfig

ZERO_MIN_TOKENS = 16  # groups with fewer sampled tokens are not judged by their zero log-probs
TOLERANCE = 1e-6  # of the range's magnitude: weighted sums round


@dataclass(frozen=True)
class Plausibility:
    reward_range: tuple[float, float] | None  # declared; None = +-max_abs_reward
    max_abs_reward: float
    sampled_at_temperature: bool  # rollout.temperature > 0
    zero_fraction: float  # broker.max_zero_logprob_fraction

    @classmethod
    def of(cls, cfg: JobConfig) -> Plausibility:
        return cls(
            declared_reward_range(cfg.rollout),
            cfg.broker.max_abs_reward,
            cfg.rollout.temperature > 0,
            cfg.broker.max_zero_logprob_fraction,
        )

    def check(self, g: m.SampleGroup) -> tuple[str, str] | None:
        """(code, reason) when ``g`` is implausible, else None."""
        return self._rewards(g) or self._logprobs(g)

    def _rewards(self, g: m.SampleGroup) -> tuple[str, str] | None:
        lo, hi = min(g.rewards), max(g.rewards)
        if g.baseline_reward is not None:
            lo, hi = min(lo, g.baseline_reward), max(hi, g.baseline_reward)
        if self.reward_range is None:
            if max(-lo, hi) > self.max_abs_reward:
                return "implausible_reward", (
                    f"group {g.group_id} has a reward of magnitude {max(-lo, hi):g} over broker.max_abs_reward="
                    f"{self.max_abs_reward:g}; scale the rewards, raise that setting, or declare the rewards' range "
                    "(rollout.rewards[].range)"
                )
            return None
        a, b = self.reward_range
        slack = TOLERANCE * max(1.0, abs(a), abs(b))
        if lo < a - slack or hi > b + slack:
            return "implausible_reward", (
                f"group {g.group_id} has a reward of {lo if lo < a - slack else hi:g} outside the job's declared range "
                f"[{a:g}, {b:g}] (rollout.rewards: each function's range x its weight); fix the rollout, or declare "
                "the range its rewards really have (rollout.rewards[].range)"
            )
        return None

    def _logprobs(self, g: m.SampleGroup) -> tuple[str, str] | None:
        if not self.sampled_at_temperature or self.zero_fraction > 1.0:
            return None
        logp = g.logprob_array()
        if logp.size < ZERO_MIN_TOKENS or float(logp.max()) < 0.0:  # no 0.0 at all: one reduction, no copy
            return None
        if len(g.loss_mask):
            logp = logp[g.loss_mask_array() == 1]
        if logp.size < ZERO_MIN_TOKENS:
            return None
        zeros = int(np.count_nonzero(logp == 0.0))
        if zeros < self.zero_fraction * logp.size:
            return None
        return "implausible_logprob", (
            f"group {g.group_id} has {zeros} of {logp.size} sampled tokens with a behaviour log-prob of exactly 0.0 at "
            f"rollout.temperature > 0 (at most {self.zero_fraction:g} of them may be, broker.max_zero_logprob_fraction); "
            "send the engine's log-probs of the sampled tokens"
        )
