"""Health rules: each judges one metric over a window (see learner/health.py for the monitor that
runs them and docs/monitoring.md for every rule's semantics and defaults)."""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from fleetrl.common.config.learner import HealthRule
from fleetrl.common.plugins.registry import Registry


@dataclass
class HealthEvent:
    step: int
    rule: str
    action: str
    metric: str
    value: float
    threshold: float
    message: str
    time: float
    server: str = ""  # per-server rules: the rollout server (client id) the event is about

    def to_json(self) -> str:
        row = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
            for k, v in asdict(self).items()
            if k != "server" or v
        }  # `server` only on per-server rules' events
        return json.dumps(row)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> HealthEvent:
        return cls(**{**row, "value": float(row["value"]), "threshold": float(row["threshold"])})

    def short(self) -> str:
        """One phrase for the live status line, e.g. ``reward_drop -> rollback @ 130``."""
        return f"{self.rule} -> {self.action}{f' {self.server}' if self.server else ''} @ {self.step}"


@dataclass
class Fired:
    """A rule's verdict at one evaluation: the value, the limit it crossed, why, and where the evidence starts."""

    value: float
    threshold: float
    message: str
    since: int
    metric: str = ""


class Rule:
    """One health rule. ``observe`` is called every step, ``on_checkpoint`` at every checkpoint."""

    METRIC: ClassVar[str] = ""
    WINDOW: ClassVar[int | None] = None
    THRESHOLD: ClassVar[float | None] = None
    STATE: ClassVar[tuple[str, ...]] = ()
    AT_CHECKPOINT: ClassVar[bool] = False  # judged by on_checkpoint (observe only accumulates)
    PER_SERVER: ClassVar[bool] = False  # judged per rollout server (learner/health_servers.py)
    PERSIST: ClassVar[bool] = False  # takes ``persist`` (steps in a row)
    EVIDENCE: ClassVar[tuple[str, ...]] = ()  # the evidence kinds ``evidence`` may pick (reward_hacking)

    def __init__(self, spec: HealthRule, key: str):
        self.spec, self.key, self.action = spec, key, spec.action
        self.metric = spec.metric or self.METRIC
        self.window = spec.window if spec.window is not None else self.WINDOW
        self.threshold = spec.threshold if spec.threshold is not None else self.THRESHOLD
        if self.threshold is not None and not math.isfinite(self.threshold):
            self.bad("threshold", "must be a finite number")
        if self.window is not None and self.window < 1:
            self.bad("window", "must be >= 1")
        if spec.persist is not None and not self.PERSIST:
            self.bad("persist", "only reward_drop takes persist; leave it out")
        if spec.evidence is not None and not self.EVIDENCE:
            self.bad("evidence", "only reward_hacking takes evidence; leave it out")
        if spec.evidence is not None and not spec.evidence:
            self.bad("evidence", f"list at least one of {', '.join(self.EVIDENCE)}, or leave it out for all")
        self.evidence = frozenset(spec.evidence if spec.evidence is not None else self.EVIDENCE)
        if self.action == "quarantine" and not self.PER_SERVER:
            self.bad(
                "action",
                "quarantine isolates one rollout server: only per-server rules (server_poison) take it; "
                "use alert, rollback or stop",
            )
        self.check()
        self.reset()

    def bad(self, field: str, why: str) -> None:
        raise ValueError(f"{self.key}.{field}={getattr(self.spec, field)!r} ({self.spec.name}): {why}")

    def check(self) -> None:
        """Rule-specific validation of window and threshold (raise with ``self.bad``)."""

    def reset(self) -> None:
        """Forget every rolling window (after a rollback)."""

    def rewind(self, step: int) -> None:
        """After a rollback to the checkpoint at ``step``: what the rule keeps of its past (by default nothing)."""
        self.reset()

    def watches(self) -> tuple[str, ...]:
        return (self.metric,)

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        return None

    def on_checkpoint(self, step: int) -> Fired | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, deque) else v for k, v in ((k, getattr(self, k)) for k in self.STATE)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        for k in (k for k in self.STATE if k in state):  # a window an older checkpoint lacks starts empty
            if isinstance(getattr(self, k), deque):
                getattr(self, k).extend(tuple(x) if isinstance(x, list) else x for x in state[k])
            else:
                setattr(self, k, state[k])


def finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if value is not None and math.isfinite(value) else None


HEALTH_RULES: Registry[type[Rule]] = Registry("health rule")


class MovingAverageRule(Rule):
    """Moving average of ``metric`` over the last ``window`` steps it was reported (finite values only)."""

    STATE = ("points",)

    def reset(self) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=self.window)

    def push(self, step: int, metrics: dict[str, float]) -> float | None:
        """Add this step's value; the moving average once the window is full (None during warm-up)."""
        value = finite(metrics, self.metric)
        if value is None:
            return None
        self.points.append((step, value))
        return sum(v for _, v in self.points) / len(self.points) if len(self.points) == self.window else None

    def onset(self, limit: float, above: bool) -> int:
        """First step in the window whose own value is beyond ``limit``: where the trouble started."""
        return next(s for s, v in self.points if (v > limit if above else v < limit))


class Limit(MovingAverageRule):
    """Fires when the moving average is above (ceiling) or below (floor) ``threshold``."""

    ABOVE: ClassVar[bool] = True
    MEANING: ClassVar[str] = ""

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        ma = self.push(step, metrics)
        if ma is None or (ma <= self.threshold if self.ABOVE else ma >= self.threshold):
            return None
        where = "above the ceiling" if self.ABOVE else "below the floor"
        return Fired(
            ma,
            self.threshold,
            f"{self.metric} averaged {ma:.4g} over the last {self.window} steps, {where} "
            f"{self.threshold:.4g}: {self.MEANING}",
            self.onset(self.threshold, self.ABOVE),
        )

    def check(self) -> None:
        if self.threshold <= 0:
            self.bad("threshold", "must be > 0 (these metrics are >= 0)")


@HEALTH_RULES.register("kl_ceiling")
class KlCeiling(Limit):
    METRIC, WINDOW, THRESHOLD = "actor/kl", 5, 1.0
    MEANING = "the policy has moved far from the reference model and may be forgetting what it knew"


@HEALTH_RULES.register("mismatch_kl_ceiling")
class MismatchKlCeiling(Limit):
    """The MA over ``window`` measured steps above the ceiling while this step's own measurement is too, or
    **one** measured step above ``SPIKE`` x the ceiling: the metric exists only on steps that trained tokens of
    the version just published, which with ``broker.max_staleness`` > 0 can be one step in fifteen, so a window of
    5 measurements may take a hundred steps to fill while a broken sync is already far off (a stale fleet measured
    0.30 on its one step). For the same reason a window can hold measurements twenty steps old: a step that
    measures the engine in agreement (at or under the ceiling) does not fire on them, where it rolled a run back
    to before a fault that had ended (benchmarks/health_recovery.py, entropy collapse: 1e-12 measured, the window's
    0.075 from steps 49-52, a rollback from step 70 to 40)."""

    METRIC, WINDOW, THRESHOLD = "off_policy/mismatch_kl", 5, 0.01
    SPIKE = 10.0
    MEANING = (
        "on tokens sampled by the very version being trained, the engine's log-probs disagree with the "
        "learner's: a broken weight sync (stale or corrupted weights under a new version number) or engine "
        "numerics (dtype, temperature, kernels), so the importance ratios are unreliable; policy drift from "
        "staleness is off_policy/drift_kl and never fires this rule"
    )

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        fired = super().observe(step, metrics)
        value = finite(metrics, self.metric)
        if value is None or value <= self.threshold:
            return None  # not measured on this step, or measured in agreement: the window's past is not now
        if fired is not None or value <= self.SPIKE * self.threshold:
            return fired
        return Fired(
            value,
            self.SPIKE * self.threshold,
            f"{self.metric} measured {value:.4g} on this step, over "
            f"{self.SPIKE:g} x the ceiling {self.threshold:.4g} (no need to wait for {self.window} measured "
            f"steps): {self.MEANING}",
            step,
        )


@HEALTH_RULES.register("entropy_floor")
class EntropyFloor(Limit):
    """The entropy MA under the floor **while the reward MA is more than ``REWARD_SLACK`` below its best** (since
    start / rollback): the policy went deterministic and is getting worse. A policy that converged on a task it
    solves (entropy near 0, the reward at its best) is success, not a collapse, and stays quiet. Without a
    reward metric the floor alone decides."""

    METRIC, WINDOW, THRESHOLD, ABOVE = "actor/entropy", 10, 0.03, False
    REWARD, REWARD_SLACK = "reward/mean", 0.1
    STATE = ("points", "rewards", "best")
    MEANING = "the policy has become nearly deterministic (entropy collapse) and stops exploring"

    def reset(self) -> None:
        super().reset()
        self.rewards: deque[tuple[int, float]] = deque(maxlen=self.window)
        self.best = -math.inf

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        reward = finite(metrics, self.REWARD)
        if reward is not None:
            self.rewards.append((step, reward))
        reward_ma = sum(v for _, v in self.rewards) / self.window if len(self.rewards) == self.window else None
        if reward_ma is not None:
            self.best = max(self.best, reward_ma)
        fired = super().observe(step, metrics)
        if fired is None or reward_ma is None:
            return fired
        if reward_ma >= self.best - self.REWARD_SLACK:
            return None  # deterministic at its best reward: converged, not collapsed
        fired.message += (
            f"; and {self.REWARD} averaged {reward_ma:.4g}, {self.best - reward_ma:.3g} below its best "
            f"{self.best:.4g} (more than {self.REWARD_SLACK:g})"
        )
        return fired


@HEALTH_RULES.register("reward_floor")
class RewardFloor(Limit):
    METRIC, WINDOW, ABOVE = "reward/mean", 5, False
    MEANING = "the policy has collapsed below the reward you set as unacceptable"

    def check(self) -> None:
        if self.threshold is None:
            self.bad("threshold", "reward_floor needs the absolute reward floor, e.g. threshold: -5.0")


@HEALTH_RULES.register("reward_drop")
class RewardDrop(MovingAverageRule):
    """Fires when the reward falls more than ``threshold`` below its best ``window``-step average since start /
    rollback: the moving average itself (``persist`` null), or each of the last ``persist`` steps' own value (a
    drop that lasts: a healthy run's reward wanders for tens of steps, a divergence sits at the bottom)."""

    METRIC, WINDOW, THRESHOLD, PERSIST = "reward/mean", 20, 0.2, True
    EARLY = 10  # with persist: the best average counts from this many steps (or `window`, if fewer) on
    STATE = ("points", "best", "best_step", "recent")

    def check(self) -> None:
        if self.threshold <= 0:
            self.bad("threshold", "the allowed drop must be > 0")

    def reset(self) -> None:
        super().reset()
        self.best, self.best_step = -math.inf, -1
        self.recent: deque[tuple[int, float]] = deque(maxlen=self.spec.persist or 1)

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        value, ma = finite(metrics, self.metric), self.push(step, metrics)
        if value is not None:
            self.recent.append((step, value))
        if self.spec.persist and len(self.points) >= min(self.window, self.EARLY):  # a collapse right after the
            ma = sum(v for _, v in self.points) / len(self.points)  # start is judged before a full window is in
        if ma is None:
            return None
        if ma > self.best:
            self.best, self.best_step = ma, step
        limit = self.best - self.threshold
        if not self.spec.persist:
            return None if ma >= limit else self.fired(ma, limit, f"averaged {ma:.4g} over the last {self.window}")
        worst_case = max(v for _, v in self.recent)  # the highest of the last `persist` steps
        if len(self.recent) < self.spec.persist or worst_case >= limit:
            return None
        return self.fired(worst_case, limit, f"stayed at or under {worst_case:.4g} for {self.spec.persist}")

    def fired(self, value: float, limit: float, what: str) -> Fired:
        return Fired(
            value,
            limit,
            f"{self.metric} {what} steps, {self.best - value:.4g} below its best {self.best:.4g} ({self.window}-step "
            f"average, step {self.best_step}), more than the allowed drop {self.threshold:.4g}: the policy is "
            "getting worse (reward collapse)",
            self.recent[0][0] if self.spec.persist else self.onset(limit, above=False),
        )


@HEALTH_RULES.register("length_collapse")
class LengthCollapse(Rule):
    """Fires when the mean over the last ``window`` steps < ``threshold`` x the mean of the ``window`` before."""

    METRIC, WINDOW, THRESHOLD = "response/length_mean", 20, 0.5
    STATE = ("points",)

    def check(self) -> None:
        if not 0 < self.threshold < 1:
            self.bad("threshold", "a fraction of the earlier mean length, in (0, 1), e.g. 0.5")

    def reset(self) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=2 * self.window)

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        value = finite(metrics, self.metric)
        if value is None:
            return None
        self.points.append((step, value))
        if len(self.points) < 2 * self.window:
            return None
        values = [v for _, v in self.points]
        before, now = sum(values[: self.window]) / self.window, sum(values[self.window :]) / self.window
        limit = self.threshold * before
        if now >= limit:
            return None
        return Fired(
            now,
            limit,
            f"{self.metric} averaged {now:.4g} over the last {self.window} steps, under "
            f"{self.threshold:.3g} x the {before:.4g} of the {self.window} steps before: responses are "
            f"collapsing (empty or truncated answers, often with reward hacking)",
            next(s for s, v in list(self.points)[self.window :] if v < limit),
        )


@HEALTH_RULES.register("grad_spike")
class GradSpike(Rule):
    """Fires when the value > ``threshold`` x the median of the previous ``window`` (finite) values."""

    METRIC, WINDOW, THRESHOLD = "actor/grad_norm", 20, 20.0  # a converged multi-turn run reached 10.4 x, healthy
    STATE = ("history",)

    def check(self) -> None:
        if self.threshold <= 1:
            self.bad("threshold", "a factor k > 1 over the rolling median, e.g. 10")
        if self.window < 3:
            self.bad("window", "the rolling median needs >= 3 steps")

    def reset(self) -> None:
        self.history: deque[float] = deque(maxlen=self.window)

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        value = finite(metrics, self.metric)
        if value is None:
            return None
        median = statistics.median(self.history) if len(self.history) == self.window else 0.0
        self.history.append(value)
        limit = self.threshold * median
        if median <= 0 or value <= limit:  # warm-up, or an all-zero history (no signal to compare with)
            return None
        return Fired(
            value,
            limit,
            f"{self.metric} = {value:.4g}, {value / median:.1f} x its median {median:.4g} over "
            f"the last {self.window} steps (limit {self.threshold:g} x): an unstable update that may "
            f"have damaged the weights",
            step,
        )


@HEALTH_RULES.register("non_finite")
class NonFinite(Rule):
    """Fires at once when any watched metric is NaN or infinite."""

    METRICS = ("actor/loss", "actor/grad_norm", "actor/kl")

    def check(self) -> None:
        if self.spec.threshold is not None:
            self.bad("threshold", "non_finite has no threshold; remove it")
        if self.spec.window is not None:
            self.bad("window", "non_finite fires on the step itself; remove the window")

    def watches(self) -> tuple[str, ...]:
        return (self.spec.metric,) if self.spec.metric else self.METRICS

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        bad = [k for k in self.watches() if k in metrics and not math.isfinite(metrics[k])]
        if not bad:
            return None
        shown = ", ".join(f"{k}={metrics[k]}" for k in bad)
        return Fired(
            float(metrics[bad[0]]),
            math.nan,
            f"non-finite {shown}: the update overflowed or diverged and the weights after this step cannot be trusted",
            step,
            metric=bad[0],
        )


@HEALTH_RULES.register("reward_checkpoint_decline")
class RewardCheckpointDecline(Rule):
    """Checkpoint-level: the mean reward since the previous checkpoint fell at each of ``window`` checkpoints
    in a row (strictly), by more than ``threshold`` in total."""

    METRIC, WINDOW, THRESHOLD = "reward/mean", 5, 0.05
    STATE = ("total", "count", "marks")
    AT_CHECKPOINT = True

    def check(self) -> None:
        if self.window < 2:
            self.bad("window", "a decline needs >= 2 checkpoints")
        if self.threshold < 0:
            self.bad("threshold", "the total decline must be >= 0")

    def reset(self) -> None:
        self.total, self.count = 0.0, 0
        self.marks: deque[tuple[int, float]] = deque(maxlen=self.window)

    def observe(self, step: int, metrics: dict[str, float]) -> Fired | None:
        value = finite(metrics, self.metric)
        if value is not None:
            self.total, self.count = self.total + value, self.count + 1
        return None

    def on_checkpoint(self, step: int) -> Fired | None:
        if not self.count:
            return None
        self.marks.append((step, self.total / self.count))
        self.total, self.count = 0.0, 0
        means = [m for _, m in self.marks]
        limit = means[0] - self.threshold
        if len(means) < self.window or any(b >= a for a, b in zip(means, means[1:])) or means[-1] >= limit:
            return None
        return Fired(
            means[-1],
            limit,
            f"{self.metric} fell at each of the last {self.window} checkpoints "
            f"({' > '.join(f'{m:.4g}' for m in means)}, steps {self.marks[0][0]}..{step}): a slow, steady "
            f"decline of the policy",
            self.marks[0][0] + 1,
        )
