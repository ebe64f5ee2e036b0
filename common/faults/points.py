"""The one seam of fault injection: named hook points, one registry, consulted here only.

Production code passes through a point by name and reads on as if nothing were there::

    params = faults.at("rollout.sampling", params, version=self.version)   # a value through a point
    with faults.around("learner.update", learner=self, step=step):       # a stretch of code
        stats = actor.step(batch)

With no fault planned (``FLEETRL_FAULT``, ``plan.py``) and no pin armed (``FLEETRL_PIN``, ``pins.py``) a
point costs one truthiness test and returns its value unchanged. Otherwise ``POINTS`` maps the point to
its hook, which may change the value (a fault) or stop the process there (a pin). Adding a fault: a hook
here, registered under the point it acts at (docs/architecture.md).

| point | value | what acts there |
| --- | --- | --- |
| ``rollout.idle``, ``rollout.generate``, ``rollout.broadcast``, ``learner.step``, ``learner.publish`` | — | pins |
| ``broker.spool_write`` | the bytes to write | pin with half of the record written |
| ``rollout.sampling`` | sampling params | ``entropy_collapse`` |
| ``rollout.scores`` | scores[part][sample] | ``nan_reward``, ``reward_hack`` |
| ``rollout.weight_load`` | the load function | ``stale_fleet``, ``corrupt_weights``, ``engine_dtype`` |
| ``rollout.version_loaded`` | the version | the clock of rollout faults |
| ``learner.update`` (``around``) | — | ``lr_spike``, ``nan_grad`` |
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fleetrl.common.faults.pins as pins  # as modules: set_plan() replaces plan.PLAN (tests)
import fleetrl.common.faults.plan as plan
from fleetrl.common.plugins.registry import Registry

T = TypeVar("T")
Hook = Callable[..., Any]  # hook(value, **context) -> value; for `around`: a context manager

POINTS: Registry[Hook] = Registry("fault hook point")


def at(point: str, value: T = None, **context: Any) -> T:  # type: ignore[assignment]
    """``value`` as it leaves the named point: unchanged unless a fault or pin is planned for this process."""
    if not (plan.PLAN or pins.POINTS):
        return value
    return POINTS[point](value, **context)


def around(point: str, **context: Any) -> contextlib.AbstractContextManager[None]:
    """A stretch of code the named point's fault acts around (a no-op context when nothing is planned)."""
    if not plan.PLAN:
        return contextlib.nullcontext()
    return POINTS[point](**context)


# ------------------------------------------------------------------------------------ pins


def _pin(point: str) -> Hook:
    def hook(value: Any = None, **_: Any) -> Any:
        pins.pin(point)
        return value

    return hook


for _point in ("rollout.idle", "rollout.generate", "rollout.broadcast", "learner.step", "learner.publish"):
    POINTS.register(_point)(_pin(_point))


@POINTS.register("broker.spool_write")
def _spool_write(view: memoryview, fd: int) -> memoryview:
    """A chaos run: stop with half of the record written; returns what is left to write."""
    if "broker.spool_write" not in pins.POINTS:
        return view
    view = view[os.write(fd, view[: len(view) // 2]) :]
    pins.pin("broker.spool_write")
    return view


# ---------------------------------------------------------------------------------- rollout


@POINTS.register("rollout.sampling")
def _sampling(params: Any, version: int) -> Any:
    """``entropy_collapse``: the temperature of a request made at ``version``."""
    if not plan.PLAN:
        return params
    return dataclasses.replace(params, temperature=plan.temperature(params.temperature, version))


@POINTS.register("rollout.scores")
def _scores(scores: list[list[Any]], responses: list[str], nan_score: Callable[[float], Any]) -> list[list[Any]]:
    plan.poison_scores(scores, responses, nan_score)
    return scores


_WEIGHT_FAULTS: weakref.WeakKeyDictionary[Any, plan.WeightFaults] = weakref.WeakKeyDictionary()


@POINTS.register("rollout.weight_load")
def _weight_load(load: Callable[[Any], int | None], pending: Callable[[], int | None], owner: Any) -> Callable:
    """The weight-sync and engine-numerics faults around ``owner``'s loads (one ``WeightFaults`` per owner)."""
    faults = _WEIGHT_FAULTS.setdefault(owner, plan.WeightFaults())
    return faults.wrap(load, pending)


@POINTS.register("rollout.version_loaded")
def _version_loaded(version: int) -> int:
    plan.note_version(version)
    return version


# ---------------------------------------------------------------------------------- learner


@POINTS.register("learner.update")
@contextlib.contextmanager
def _update(learner: Any, step: int) -> Iterator[None]:
    """``lr_spike`` multiplies the LR state (the scheduler's base LR too, so it stays until a checkpoint is
    restored), ``nan_grad`` makes every gradient of the step NaN."""
    factor = plan.lr_multiplier(step)
    if factor != 1.0:
        learner.scheduler.base_lrs = [lr * factor for lr in learner.scheduler.base_lrs]
        for group in learner.optimizer.param_groups:
            group["lr"] *= factor
    hooks = plan.poison_grads(learner.module, step)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
