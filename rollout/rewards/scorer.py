"""``RewardScorer``: the configured rewards, combined with weights, scored in the background.

The rollout server builds one scorer at start-up (bad names and arguments fail there) and submits
each generated batch; the returned future completes while the engine generates the next batch.
A part that raises, times out, or returns a non-number or a non-finite value marks its sample
failed: the failure is counted and logged, the part adds 0.0, and the server decides with
``should_drop`` whether the sample's group is trained on (``on_failure: zero``) or dropped
(``on_failure: drop_group``). No failure reaches the server as an exception.

A part that returns None has no score for that sample (TRL's convention): it is counted
(``reward/<label>/unscored_total``) and left out of the weighted sum; a sample no part scored is
``scored=False`` and the server leaves it out of its group — it is never trained on as a 0.

Once ``rollout.reward_stop_after`` samples in a row got no usable reward (``streak.py``), ``hopeless()``
says why, naming each reward, and the server stops: at the start of a run or whenever the rewards stop working.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from fleetrl.common import faults
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.rollout.rewards.base import REWARDS, Reward, RewardArgsError, RewardInput, RewardResult
from fleetrl.rollout.rewards.runner import CallRunner, CallTimeout
from fleetrl.rollout.rewards.streak import UnusableStreak

if TYPE_CHECKING:
    from fleetrl.common.config.schema import RewardSpec, RolloutConfig

log = logging.getLogger(__name__)


@dataclass
class Part:
    """One configured reward: its unique label (``math``, ``regex_2``...), weight and scorer."""

    name: str
    weight: float
    reward: Callable[[list[RewardInput]], list[float]]
    key: str = ""  # its config entry, rollout.rewards[i], named in failure messages


UNSCORED = None  # what a part returns for a sample it cannot score
HOPELESS_SAMPLES = 32  # this many samples in a row with no usable reward stop the server (rollout.reward_stop_after)


class RewardsHopeless(RuntimeError):
    """The last rollout.reward_stop_after samples got no usable reward: every one failed or was unscored (the
    message names the rewards)."""


@dataclass(frozen=True)
class Failure:
    """Why one part could not score one sample; ``kind`` picks the counter it adds to."""

    kind: Literal["timeout", "error", "nonfinite"]
    reason: str


def _bind(factory: Callable[..., Any], args: dict[str, Any]) -> None:
    """Reject keywords a plain factory function does not take, before calling it."""
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        raise RewardArgsError(
            f"{e}; {getattr(factory, '__name__', factory)!s} takes: {inspect.signature(factory)}"
        ) from None


def build_parts(specs: Sequence[RewardSpec]) -> list[Part]:
    """Instantiate ``rollout.rewards``; unknown names and bad args raise naming the config key."""
    if not specs:
        raise ValueError("rollout.rewards is empty; configure at least one reward, e.g. [{name: math}]")
    parts: list[Part] = []
    seen: Counter[str] = Counter()
    for i, spec in enumerate(specs):
        try:
            factory = REWARDS[spec.name]
        except RegistryError as e:
            raise RegistryError(f"rollout.rewards[{i}].name: {e}") from None
        try:
            if not (isinstance(factory, type) and issubclass(factory, Reward)):  # Reward classes check their Args
                _bind(factory, spec.args)
            reward = factory(**spec.args)
        except RewardArgsError as e:
            raise RewardArgsError(f"rollout.rewards[{i}].args: {e}") from None
        label = spec.label or getattr(reward, "label", spec.name)
        seen[label] += 1
        name = label if seen[label] == 1 else f"{label}_{seen[label]}"
        parts.append(Part(name, spec.weight, reward, f"rollout.rewards[{i}]"))
    return parts


def check_rewards(specs: Sequence[RewardSpec]) -> list[str]:
    """`fleetrl config validate`'s check of ``rollout.rewards``: names, arguments, user functions and model
    directories, without building heavy rewards; one line per problem, naming the key."""
    if not specs:
        return ["rollout.rewards is empty; configure at least one reward, e.g. [{name: math}]"]
    problems = []
    for i, spec in enumerate(specs):
        key = f"rollout.rewards[{i}]"
        try:
            factory = REWARDS[spec.name]
            if isinstance(factory, type) and issubclass(factory, Reward):
                factory.check(**spec.args)
            else:
                _bind(factory, spec.args)
        except RegistryError as e:
            problems.append(f"{key}.name: {e}")
        except RewardArgsError as e:
            problems.append(f"{key}.args: {e}")
    return problems


def per_sample(reward: Any) -> bool:
    """Whether the scorer calls ``reward`` once per sample (``score``) rather than once per batch."""
    return isinstance(reward, Reward) and reward.per_sample


def as_score(value: Any) -> float | Failure | None:
    """A reward's return value as a finite float, None (no score), or the failure it is."""
    if value is None:
        return UNSCORED
    if isinstance(value, (str, bytes)):
        return Failure("nonfinite", f"returned {type(value).__name__} {str(value)[:40]!r}, expected a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        return Failure("nonfinite", f"returned {type(value).__name__}, expected a number")
    return x if math.isfinite(x) else Failure("nonfinite", f"returned non-finite {x}")


def outcome(fut: Future, n: int, batched: bool) -> list[float | Failure | None]:
    """The ``n`` scores a finished call produced: one for a per-sample call, ``n`` for a batch call."""
    if fut.cancelled():
        return [Failure("error", "cancelled: the scorer was closed")] * n
    exc = fut.exception()
    if isinstance(exc, CallTimeout):
        return [Failure("timeout", str(exc))] * n
    if exc is not None:
        return [Failure("error", f"{type(exc).__name__}: {str(exc)[:200]}")] * n
    value = fut.result()
    if not batched:
        return [as_score(value)]
    values = list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
    if values is None or len(values) != n:
        got = f"{len(values)} scores" if values is not None else type(value).__name__
        return [Failure("error", f"returned {got} for a batch of {n} samples")] * n
    return [as_score(v) for v in values]


@dataclass(eq=False)
class _Job:
    """One submitted batch: the part x sample score table, filled in by call callbacks."""

    batch: list[RewardInput]
    scores: list[list[float | Failure | None]]
    out: Future = field(default_factory=Future)
    remaining: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class RewardScorer:
    """Scores batches with the weighted rewards of ``rollout.rewards``; see the module docstring.

    ``workers`` threads run sync calls (each sample of each per-sample reward is its own call,
    limited to ``timeout_s`` seconds from when it starts); ``async def`` rewards run on one event
    loop; batch rewards (``model``) run on a worker without a time limit.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        timeout_s: float = 10.0,
        workers: int = 4,
        on_failure: Literal["zero", "drop_group"] = "zero",
        stop_after: int = HOPELESS_SAMPLES,
    ):
        if on_failure not in ("zero", "drop_group"):
            raise ValueError(f"rollout.on_reward_failure: {on_failure!r} is not one of zero, drop_group")
        if not timeout_s > 0 or workers < 1:
            raise ValueError("rollout.reward_timeout_s must be > 0 and rollout.reward_workers >= 1")
        self.parts = build_parts(specs)
        self.timeout_s, self.on_failure = timeout_s, on_failure
        self._runner = CallRunner(workers, name="reward")
        self._lock = threading.Lock()
        self._totals: Counter[str] = Counter()
        self._window: Counter[str] = Counter()
        self._streak = UnusableStreak([(p.name, p.key) for p in self.parts], stop_after)  # hopeless()

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> RewardScorer:
        return cls(cfg.rewards, cfg.reward_timeout_s, cfg.reward_workers, cfg.on_reward_failure, cfg.reward_stop_after)

    # ----------------------------------------------------------------------------------- scoring

    def submit(self, batch: Sequence[RewardInput]) -> Future[list[RewardResult]]:
        """Start scoring ``batch``; the future holds one ``RewardResult`` per sample, in order."""
        job = _Job(list(batch), [[None] * len(batch) for _ in self.parts])
        job.out.set_running_or_notify_cancel()
        calls = [call for k, part in enumerate(self.parts) for call in self._calls(k, part.reward, job.batch)]
        job.remaining = len(calls)
        if not calls:
            self._finish(job)
        for k, idx, fut in calls:
            fut.add_done_callback(partial(self._collect, job, k, idx))
        return job.out

    def score(self, batch: Sequence[RewardInput]) -> list[RewardResult]:
        """``submit(batch).result()``: blocks until every part of every sample is scored or failed."""
        return self.submit(batch).result()

    def should_drop(self, group: Sequence[RewardResult]) -> bool:
        """Whether the server drops this group: ``on_failure: drop_group`` and a sample failed."""
        return self.on_failure == "drop_group" and any(r.failed for r in group)

    def _calls(self, k: int, reward: Any, batch: list[RewardInput]) -> list[tuple[int, range, Future]]:
        """Submit part ``k``: one call per sample under the time limit, or one batch call (time-limited when
        the reward says so: batched user functions)."""
        if not per_sample(reward):
            if not batch:
                return []
            limit = self.timeout_s if getattr(reward, "time_limited", False) else None
            if getattr(reward, "is_async", False):
                return [(k, range(len(batch)), self._runner.submit_async(reward.acall, batch, limit))]
            return [(k, range(len(batch)), self._runner.submit(reward, batch, limit))]
        submit, fn = (
            (self._runner.submit_async, reward.ascore) if reward.is_async else (self._runner.submit, reward.score)
        )
        return [(k, range(j, j + 1), submit(fn, x, self.timeout_s)) for j, x in enumerate(batch)]

    def _collect(self, job: _Job, k: int, idx: range, fut: Future) -> None:
        scores = outcome(fut, len(idx), batched=not per_sample(self.parts[k].reward))
        with job.lock:
            for j, s in zip(idx, scores):
                job.scores[k][j] = s
            job.remaining -= 1
            done = job.remaining == 0
        if done:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        try:
            faults.at("rollout.scores", job.scores, responses=[b.response for b in job.batch], nan_score=as_score)
            results = [self._combine(job.scores, j) for j in range(len(job.batch))]
            self._record(job, results)
        except Exception as e:  # a bug here must reach the waiting server, not vanish in a callback
            job.out.set_exception(e)
            return
        job.out.set_result(results)

    def _combine(self, scores: list[list[float | Failure | None]], j: int) -> RewardResult:
        parts: dict[str, float] = {}
        total, error, failed = 0.0, "", []
        for part, row in zip(self.parts, scores):
            s = row[j]
            if s is UNSCORED:
                continue
            if isinstance(s, Failure):
                parts[part.name] = 0.0
                failed.append(part.name)
                error = error or f"{part.name}: {s.reason}"
            else:
                parts[part.name] = s
                total += part.weight * s
        if not error and not math.isfinite(total):
            total, error = 0.0, f"weighted sum is not finite ({parts})"
        return RewardResult(
            reward=total, parts=parts, failed=bool(error), error=error, scored=bool(parts), failed_parts=tuple(failed)
        )

    # ------------------------------------------------------------------------------------ stats

    def _record(self, job: _Job, results: list[RewardResult]) -> None:
        failures: list[tuple[Part, Failure, int]] = []
        warn: tuple[int, str] | None = None
        with self._lock:
            t, w = self._totals, self._window
            t["samples"] += len(results)
            w["batches"] += 1
            w["batch_s"] += time.monotonic() - job.started
            for j, r in enumerate(results):
                t["failed"] += r.failed
                t["unscored"] += not r.scored
                w["n"] += r.scored
                w["reward"] += r.reward if r.scored else 0.0
                failed, unscored = {}, []
                for part, row in zip(self.parts, job.scores):
                    s = row[j]
                    if s is UNSCORED:
                        t[f"{part.name}/unscored"] += 1
                        unscored.append(part.name)
                    elif isinstance(s, Failure):
                        t[f"kind/{s.kind}"] += 1
                        t[f"{part.name}/failed"] += 1
                        failed[part.name] = s.reason
                        failures.append((part, s, t[f"{part.name}/failed"]))
                    else:
                        w[f"{part.name}/n"] += 1
                        w[f"{part.name}/sum"] += s
                if self._streak.add(r.scored and not r.failed, failed, unscored):  # half way to the stop: say so
                    warn = (self._streak.length, self._streak.what_each_did())
        for part, f, count in failures:
            if count in (1, 10, 100) or count % 1000 == 0:  # a steady failure is logged, not flooded
                log.warning(
                    "reward %r (%s) failed on a sample (%s; %d such failures so far): it adds 0 to the reward%s; "
                    "fix the function or %s",
                    part.name,
                    part.key,
                    f.reason,
                    count,
                    ", and its group is dropped" if self.on_failure == "drop_group" else "",
                    part.key,
                )
        if warn:
            log.warning(
                "the last %d samples got no usable reward (%s); the server stops at %d in a row "
                "(rollout.reward_stop_after)",
                *warn,
                self._streak.limit,
            )

    def hopeless(self) -> str | None:
        """Why training cannot go on, once the last ``stop_after`` samples in a row got no usable reward (every
        one had a failed part or no score at all), from the start of the run or later; else None. The message
        names each reward, what it did over those samples, and the config entry to fix."""
        with self._lock:
            return self._streak.why()

    def stats(self) -> dict[str, float]:
        """Counters since start (``*_total``) and means since the previous ``stats()`` call."""
        with self._lock:
            t, w = self._totals, self._window
            out = {
                "reward/samples_total": float(t["samples"]),
                "reward/failed_total": float(t["failed"]),
                "reward/unscored_total": float(t["unscored"]),
                "reward/timeouts_total": float(t["kind/timeout"]),
                "reward/errors_total": float(t["kind/error"]),
                "reward/nonfinite_total": float(t["kind/nonfinite"]),
                "reward/abandoned_threads": float(self._runner.abandoned),
            }
            if w["n"]:
                out["reward/mean"] = w["reward"] / w["n"]
                out["timing/reward_batch_s"] = w["batch_s"] / w["batches"]
            for part in self.parts:
                out[f"reward/{part.name}/failed_total"] = float(t[f"{part.name}/failed"])
                out[f"reward/{part.name}/unscored_total"] = float(t[f"{part.name}/unscored"])
                if w[f"{part.name}/n"]:
                    out[f"reward/{part.name}/mean"] = w[f"{part.name}/sum"] / w[f"{part.name}/n"]
            self._window = Counter()
        return out

    def close(self) -> None:
        """Stop the worker threads and release the rewards (reward models)."""
        self._runner.close()
        for part in self.parts:
            if hasattr(part.reward, "close"):
                part.reward.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
