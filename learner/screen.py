"""The fleet screen: a leased group that no honest rollout server could have sent stays out of the step.

One rollout server that sends poison (a broken reward deployment paying -1e6, an engine that reports
log-probs of exactly 0.0) must not roll back or stop a whole run: the aggregate rules would read its
groups as a collapse of the policy. So before a step trains, every leased group is judged on its own,
against what is possible and against the rest of the fleet, and a group that fails is left out of the
step (acknowledged, so the broker forgets it; listed in ``trained-<rank>.jsonl`` as ``screened_ids``)
and counted against the server that sent it (``SampleGroup.server_id``). The health rule
``server_poison`` (learner/health_servers.py) reads those counts and quarantines a server that keeps
sending such groups. No declared reward range is needed:

- **impossible log-probs**: a sampled token (loss mask 1) with a behaviour log-prob above 0, or every
  sampled token's log-prob exactly 0.0 while two responses start with different tokens (their first
  tokens come from one distribution, so they cannot both have probability 1);
- **a reward far outside the fleet's**: ``|r - median| > health.screen.reward_spread x max(IQR, 1)`` over
  the rewards of the last ``health.screen.history`` samples that passed (robust to a poisoning minority);
  judged once ``health.screen.warmup`` samples have passed (non-finite rewards never get this far:
  ``SampleGroup`` refuses them at decode).

Pure numpy over the groups' arrays; the same on every rank given the same groups.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from fleetrl.common import messages as m
from fleetrl.common.config.learner import ScreenConfig

LOGPROB_SLACK = 1e-6  # engines compute log-softmax in float; a sampled token's log-prob is <= 0 up to this


@dataclass
class Screened:
    """One step's verdicts: the groups kept, and per server the groups left out and why."""

    kept: list[m.SampleGroup]
    dropped: list[m.SampleGroup] = field(default_factory=list)
    reasons: dict[str, list[str]] = field(default_factory=dict)  # server -> why each of its groups was left out
    seen: Counter = field(default_factory=Counter)  # server -> groups judged

    def per_server(self) -> dict[str, dict[str, float]]:
        """``{server: {"groups": n, "screened": k}}`` for the health monitor (summed over ranks by the caller)."""
        return {s: {"groups": float(n), "screened": float(len(self.reasons.get(s, [])))} for s, n in self.seen.items()}


class FleetScreen:
    def __init__(self, cfg: ScreenConfig):
        self.cfg = cfg
        self.rewards: deque[float] = deque(maxlen=cfg.history)

    def judge(self, groups: list[m.SampleGroup], quarantined: set[str] = frozenset()) -> Screened:
        """Keep the plausible groups of servers not in ``quarantined``; the rest are dropped with a reason."""
        out = Screened(kept=[])
        if not self.cfg.enabled:
            out.kept = list(groups)
            return out
        span = self.reward_span()
        for g in groups:
            server = g.server_id or "(unnamed)"
            out.seen[server] += 1
            why = f"server {server} is quarantined" if server in quarantined else self.implausible(g, span)
            if why is None:
                out.kept.append(g)
                self.rewards.extend(g.rewards)
            else:
                out.dropped.append(g)
                out.reasons.setdefault(server, []).append(why)
        return out

    def reward_span(self) -> tuple[float, float] | None:
        """(median, allowed distance) of the fleet's recent rewards, or None before ``warmup`` samples."""
        if len(self.rewards) < self.cfg.warmup:
            return None
        q1, med, q3 = np.percentile(np.fromiter(self.rewards, float), [25, 50, 75])
        return float(med), self.cfg.reward_spread * max(float(q3 - q1), 1.0)

    def implausible(self, g: m.SampleGroup, span: tuple[float, float] | None) -> str | None:
        if span is not None:  # rewards are finite: SampleGroup refuses the others at decode
            med, allowed = span
            far = max(g.rewards, key=lambda r: abs(r - med))
            if abs(far - med) > allowed:
                return (
                    f"group {g.group_id}: reward {far:.6g} lies {abs(far - med):.3g} from the fleet's median "
                    f"{med:.4g}, more than {allowed:.3g} (health.screen.reward_spread x max(IQR, 1))"
                )
        return impossible_logprobs(g)


def impossible_logprobs(g: m.SampleGroup) -> str | None:
    """Why the behaviour log-probs of ``g`` cannot come from sampling, or None (see the module docstring)."""
    sampled = g.logprob_array()[g.loss_mask_array() > 0]
    if sampled.size == 0:
        return None
    if sampled.max() > LOGPROB_SLACK:
        return f"group {g.group_id}: a sampled token has behaviour log-prob {float(sampled.max()):.4g} > 0"
    tokens, offsets = g.token_array(), g.offsets()
    firsts = {int(tokens[a]) for a, b in zip(offsets[:-1], offsets[1:]) if b > a}
    if len(firsts) > 1 and not np.any(sampled != 0.0):
        return (
            f"group {g.group_id}: every sampled token has behaviour log-prob exactly 0.0 (probability 1), yet "
            f"its responses start with {len(firsts)} different tokens"
        )
    return None
