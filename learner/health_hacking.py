"""The ``reward_hacking`` health rule: training reward going up while what the reward cannot see gets worse.

Its own module for size; it registers in ``learner/health_rules.py``'s registry when ``learner/health.py``
imports it (as the per-server rules of ``learner/health_servers.py`` do). docs/monitoring.md, "The rules".
"""

from __future__ import annotations

from collections import deque
from typing import Any

from fleetrl.learner.health_rules import HEALTH_RULES, Fired, Rule, finite


@HEALTH_RULES.register("reward_hacking")
class RewardHacking(Rule):
    """Training reward going up while what the reward cannot see gets worse (docs/monitoring.md).

    Three kinds of evidence, each enough on its own:

    * **held-out divergence** (judged at each evaluation): over the last ``EVALS`` evaluations, or all
      those of the last ``2 x window`` steps when that is more (a probe run more often keeps its reach),
      ``eval/accuracy`` fell more than ``threshold`` below the best of them while the training reward's
      moving average (``window`` steps) rose more than ``REWARD_RISE`` since that best evaluation;
    * **cheap signals** (every step, between evaluations): with the reward's moving average at or above
      the run's own baseline (its first ``window`` steps since start / rollback), at least one of the
      response length under ``LENGTH_FRACTION`` x its baseline, ``response/distinct_2`` under
      ``DISTINCT_FRACTION`` x its baseline, or ``response/identical_frac`` above ``IDENTICAL_CEILING``
      and ``IDENTICAL_RISE`` above its baseline (all moving averages over ``window`` steps).

    * **held-out answers** (judged at each evaluation): the held-out greedy answers' mean length
      (``eval/response_len_mean``: the same problems every time) under ``1 - ANSWER_SHIFT`` x its baseline
      (the mean of the last ``EVALS`` evaluations within ``ANSWER_SHIFT`` of theirs: a slow healthy drift
      moves it, a hack or a burst of garbage does not; kept across a rollback up to the restored step) while the reward's moving average
      and the mean of its last ``window // 2`` steps are at or above the reward's baseline (a hack pays; a
      divergence's reward falls to 0 first) and ``eval/accuracy`` is not above the best of those baseline
      evaluations (a healthy run that learns to answer more concisely gets more answers right).

    ``since`` is where the divergence began: the step after the best evaluation, the first step in the
    window whose own value crossed a cheap signal's limit, or the step after the last evaluation whose
    answers were within the limit.
    """

    METRIC, WINDOW, THRESHOLD = "reward/mean", 10, 0.1
    EVAL, LENGTH, DISTINCT, IDENTICAL = (
        "eval/accuracy",
        "response/length_mean",
        "response/distinct_2",
        "response/identical_frac",
    )
    EVALS, REWARD_RISE = 3, 0.05
    LENGTH_FRACTION, DISTINCT_FRACTION, IDENTICAL_CEILING, IDENTICAL_RISE = 0.6, 0.5, 0.5, 0.25
    ANSWER_LENGTH, ANSWER_SHIFT = "eval/response_len_mean", 0.03  # healthy runs: <= 1.6% (docs/monitoring.md)
    STATE = ("recent", "base_sum", "base_n", "evals", "answers")
    EVIDENCE = ("divergence", "answers", "signals")  # health.rules[].evidence picks among them (default: all)

    def check(self) -> None:
        if not 0 < self.threshold < 1:
            self.bad("threshold", "the held-out accuracy drop that counts, in (0, 1), e.g. 0.1")
        if self.window < 2:
            self.bad("window", "the moving averages need >= 2 steps")

    def reset(self) -> None:
        keys = self.signals()
        self.recent: dict[str, deque[tuple[int, float]]] = {k: deque(maxlen=self.window) for k in keys}
        self.base_sum, self.base_n = {k: 0.0 for k in keys}, {k: 0 for k in keys}
        self.evals: deque[tuple[int, float, float]] = deque(maxlen=64)  # (step, accuracy, reward MA)
        # (step, length, accuracy) of the last clean evaluations
        self.answers: deque[tuple[int, float, float | None]] = deque(maxlen=self.EVALS)

    def signals(self) -> tuple[str, ...]:
        return (self.metric, self.LENGTH, self.DISTINCT, self.IDENTICAL)

    def watches(self) -> tuple[str, ...]:
        return (*self.signals(), self.EVAL, self.ANSWER_LENGTH)

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": {k: list(v) for k, v in self.recent.items()},
            "base_sum": dict(self.base_sum),
            "base_n": dict(self.base_n),
            "evals": list(self.evals),
            "answers": list(self.answers),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        for k, points in state["recent"].items():
            self.recent[k].extend(tuple(p) for p in points)
        self.base_sum.update(state["base_sum"])
        self.base_n.update(state["base_n"])
        self.evals.extend(tuple(e) for e in state["evals"])
        for a in state.get("answers", []):  # an older checkpoint: a fresh baseline
            self.answers.append((a[0], a[1], a[2] if len(a) > 2 else None))

    def rewind(self, step: int) -> None:
        answers = [a for a in self.answers if a[0] <= step]  # the restored policy's own held-out answers
        self.reset()
        self.answers.extend(answers)

    def ma(self, key: str) -> float | None:
        points = self.recent[key]
        return sum(v for _, v in points) / len(points) if len(points) == self.window else None

    def baseline(self, key: str) -> float | None:
        return self.base_sum[key] / self.base_n[key] if self.base_n[key] == self.window else None

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        for key in self.signals():
            value = finite(metrics, key)
            if value is None:
                continue
            self.recent[key].append((step, value))
            if self.base_n[key] < self.window:
                self.base_sum[key] += value
                self.base_n[key] += 1
        reward = self.ma(self.metric)
        accuracy = finite(metrics, self.EVAL)
        if accuracy is not None and reward is not None:
            self.evals.append((step, accuracy, reward))
            fired = self.held_out_divergence() if "divergence" in self.evidence else None
            if fired is not None:
                return fired
        fired = self.held_out_answers(step, finite(metrics, self.ANSWER_LENGTH), accuracy)
        if fired is not None and "answers" in self.evidence:
            return fired
        return self.cheap_signals(step) if "signals" in self.evidence else None

    def reward_holds(self) -> bool:
        """The reward's moving average and the mean of its last ``window // 2`` steps at or above its baseline."""
        reward, base = self.ma(self.metric), self.baseline(self.metric)
        last = [v for _, v in self.recent[self.metric]][-max(2, self.window // 2) :]
        return reward is not None and base is not None and reward >= base and sum(last) / len(last) >= base

    def held_out_answers(self, step: int, length: float | None, accuracy: float | None) -> Fired | None:
        if length is None:
            return None
        if len(self.answers) < self.EVALS:
            self.answers.append((step, length, accuracy))
            return None
        base = sum(a[1] for a in self.answers) / len(self.answers)
        limit = (1 - self.ANSWER_SHIFT) * base
        if length > (1 + self.ANSWER_SHIFT) * base:
            return None  # longer: not what this evidence watches, and no baseline (a divergence's garbage)
        if length >= limit:
            self.answers.append((step, length, accuracy))
            return None
        if not self.reward_holds():
            return None  # shorter but unpaid: not a hack (a divergence's reward is at 0); not a baseline either
        best = max((a[2] for a in self.answers if a[2] is not None), default=None)
        if accuracy is not None and best is not None and accuracy > best:
            return None  # shorter and more often right than ever in the baseline: concise, not hacked
        clean = self.answers[-1][0]
        return Fired(
            length,
            limit,
            f"held-out answers got shorter: {self.ANSWER_LENGTH} {length:.4g} tokens, under "
            f"{1 - self.ANSWER_SHIFT:g} x {base:.4g} (its last {self.EVALS} evaluations within the limit, up to "
            f"step {clean}), while {self.metric} held at or above its baseline and {self.EVAL} did not beat "
            f"theirs: the policy answers the same problems differently for more reward (reward hacking)",
            clean + 1,
            metric=self.ANSWER_LENGTH,
        )

    def held_out_divergence(self) -> Fired | None:
        step, acc, reward = self.evals[-1]
        span = [e for e in self.evals if e[0] >= step - 2 * self.window]
        recent = span if len(span) > self.EVALS else list(self.evals)[-self.EVALS :]
        best_step, best_acc, best_reward = max(recent, key=lambda e: e[1])
        drop, rise = best_acc - acc, reward - best_reward
        if drop <= self.threshold or rise <= self.REWARD_RISE:
            return None
        return Fired(
            acc,
            best_acc - self.threshold,
            f"held-out {self.EVAL} fell {drop:.3g} (from {best_acc:.3g} at "
            f"step {best_step} to {acc:.3g}, more than {self.threshold:.3g}) while {self.metric} rose "
            f"{rise:.3g} (moving average {best_reward:.4g} -> {reward:.4g}): the policy is learning to please "
            f"the reward, "
            f"not the task (reward hacking)",
            best_step + 1,
            metric=self.EVAL,
        )

    def cheap_signals(self, step: int) -> Fired | None:
        reward, reward_base = self.ma(self.metric), self.baseline(self.metric)
        if reward is None or reward_base is None or reward < reward_base:
            return None  # a falling reward is reward_drop's; a hack pays
        found: list[tuple[str, float, float, int]] = []  # (what, value, limit, onset)
        for key, fraction in ((self.LENGTH, self.LENGTH_FRACTION), (self.DISTINCT, self.DISTINCT_FRACTION)):
            now, base = self.ma(key), self.baseline(key)
            if now is not None and base is not None and base > 0 and now < fraction * base:
                limit = fraction * base
                found.append(
                    (
                        f"{key} averaged {now:.4g}, under {fraction:g} x its baseline {base:.4g}",
                        now,
                        limit,
                        next(s for s, v in self.recent[key] if v < limit),
                    )
                )
        now, base = self.ma(self.IDENTICAL), self.baseline(self.IDENTICAL)
        if now is not None and base is not None:
            limit = max(self.IDENTICAL_CEILING, base + self.IDENTICAL_RISE)
            if now > limit:
                found.append(
                    (
                        f"{self.IDENTICAL} averaged {now:.4g}, above {limit:.3g} (baseline {base:.4g}): one "
                        f"response answers many different prompts",
                        now,
                        limit,
                        next(s for s, v in self.recent[self.IDENTICAL] if v > limit),
                    )
                )
        if not found:
            return None
        what, value, limit, _ = found[0]
        metric = what.split(" ", 1)[0]
        return Fired(
            value,
            limit,
            f"{'; '.join(f[0] for f in found)}, over the last {self.window} steps, while "
            f"{self.metric} averaged {reward:.4g} (baseline {reward_base:.4g}): the samples degenerate as the "
            f"reward holds or rises (reward hacking)",
            min(f[3] for f in found),
            metric=metric,
        )
