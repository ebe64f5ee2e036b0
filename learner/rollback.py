"""The circuit breaker's rollback: put the learner and the fleet back on the newest healthy checkpoint.

    pause the fleet → restore model, optimizer, scheduler, RNG and the data cursor → LR × health.lr_factor
    → the abandoned branch's groups: rewound, and those of the rolled-back versions discarded at the broker
    → publish the restored weights as a new version → resume the fleet → the event on the timeline

After it, no group with a token sampled by a rolled-back version reaches the learner: the broker drops
the queued ones and every late arrival (``broker/server/control.py``, ``broker/server/queue.py`` ``touches``), and the
rollout servers load the restored weights before they lease again (the publish precedes the resume).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry import tracing
from fleetrl.learner.checkpoint import Checkpointer, set_rng_state, tag_of
from fleetrl.learner.runtime import Dist

log = logging.getLogger("fleetrl.learner")


@dataclass
class RollbackParts:
    """What a rollback restores and whom it tells, handed over by ``Learner.rollback``; ``step`` and ``version``
    are the learner's at the moment the rule fired."""

    cfg: JobConfig
    ckpt: Checkpointer
    engine: Any  # the policy's DeepSpeed engine (model, optimizer, scheduler)
    actor: Any  # PolicyActor | DpoActor
    critic: Any  # learner/critic.py, or None
    generator: torch.Generator
    source: Any  # the batch source (its data cursor)
    health: Any  # learner/health.py's HealthMonitor
    client: Any  # the broker client (None without a fleet)
    dist: Dist
    trained_log: Any  # trained-<rank>.jsonl
    fleet: bool  # rollout servers take the weights (not offline DPO)
    step: int
    version: int
    publish: Callable[[], int]  # send the current weights as a new policy version; returns that version
    set_lr_scale: Callable[[float], None]  # the LR multiplier, health.lr_factor ** rollbacks


def roll_back(parts: RollbackParts, reason: str) -> bool:
    """Restore the newest healthy checkpoint; False if there is none (the caller alerts, or stops the run).

    The learner keeps counting steps forward (the abandoned steps stay in the logs) and publishes the
    restored weights as a version newer than every rolled-back one, so versions never go back.
    """
    start_ns = time.time_ns()
    steps = [int(path.name.split("-")[1]) for path in parts.ckpt.complete()]
    target_step = parts.health.rollback_target(steps)
    if target_step is None:
        return False  # the caller decides what then (HealthMonitor.rollback_unavailable)
    target = parts.ckpt.dir / tag_of(target_step)
    for step in steps:
        if step > target_step:  # the abandoned timeline's checkpoints are never rollback targets
            parts.ckpt.mark_healthy(parts.ckpt.dir / tag_of(step), False)
    main = parts.dist.is_main and parts.fleet
    if main:
        parts.client.control("pause", reason=f"rollback: {reason}")
    state = parts.ckpt.load(parts.engine, target)  # model, optimizer, scheduler
    if parts.critic is not None:
        parts.critic.load(target)
    bad_from, bad_to = state["version"] + 1, parts.version
    lr_scale = restore_state(parts, state)
    requeued = discard_abandoned(parts, target.name, target_step, bad_from, bad_to) if parts.fleet else 0
    parts.health.record_rollback(to_step=state["step"], from_step=parts.step)
    parts.health.rewind_to(state.get("health"), state["step"])
    published = parts.version
    if parts.fleet:
        published = parts.publish()  # the restored weights, as a version newer than every rolled-back one
    if main:
        parts.client.control("resume", reason="rollback done")
    record_timeline(
        parts, start_ns, reason, target_step, state["version"], bad_from, bad_to, requeued, published, lr_scale
    )
    log.warning(
        "health: rolled back to %s (policy version %d), lr x%.3g, discarded versions %d..%d, published version %d: %s",
        target.name,
        state["version"],
        lr_scale,
        bad_from,
        bad_to,
        published,
        reason,
    )
    return True


def restore_state(parts: RollbackParts, state: dict) -> float:
    """Actor state, RNG streams and the data cursor as they were at the checkpoint; the LR lowered (returned:
    the new LR multiplier)."""
    parts.actor.load_state_dict(state["actor"])
    set_rng_state(state["rng"])
    parts.generator.set_state(state["generator"])
    parts.source.load_state_dict(state.get("source", {}))
    lr_scale = state.get("lr_scale", 1.0) * parts.cfg.health.lr_factor
    parts.set_lr_scale(lr_scale)
    return lr_scale


def discard_abandoned(parts: RollbackParts, name: str, target_step: int, bad_from: int, bad_to: int) -> int:
    """The broker forgets the abandoned branch: with ``broker.commit_on_checkpoint`` every rank's groups
    trained since the checkpoint come back first (the data cursor rewinds to the checkpoint's); then,
    once every rank has rewound, rank 0 has every group with a token from versions ``[bad_from, bad_to]``
    dropped (those that just came back included), its prompt issued again, and late arrivals from those
    versions refused. Returns how many of this rank's groups came back."""
    back = 0
    if parts.cfg.broker.commit_on_checkpoint:
        back = parts.client.rewind(target_step).count
    if parts.dist.world > 1:
        tdist.barrier()  # the discard must see every rank's rewound groups
    if parts.dist.is_main:
        parts.client.control("discard", reason=f"rollback to {name}", min_version=bad_from, max_version=bad_to)
    return back


def record_timeline(
    parts: RollbackParts,
    start_ns: int,
    reason: str,
    target_step: int,
    version: int,
    bad_from: int,
    bad_to: int,
    requeued: int,
    published: int,
    lr_scale: float,
) -> None:
    """The rollback in the trained log (``trained-<rank>.jsonl``) and as a ``learner.rollback`` span (a root:
    it belongs to no group's trace); the events.jsonl line is ``HealthMonitor.record_rollback``'s."""
    parts.trained_log.write(
        {
            "rollback": parts.step,
            "to_step": target_step,
            "restored_version": version,
            "discarded": [bad_from, bad_to],
            "published_version": published,
            "time": time.time(),
        }
    )
    tracing.record_span(
        "learner.rollback",
        start_ns,
        parent=tracing.ROOT,
        attributes={
            "fleetrl.step": parts.step,
            "fleetrl.rollback.to_step": target_step,
            "fleetrl.rollback.reason": reason,
            "fleetrl.rollback.restored_version": version,
            "fleetrl.rollback.discarded_min_version": bad_from,
            "fleetrl.rollback.discarded_max_version": bad_to,
            "fleetrl.policy_version": published,
            "fleetrl.rollback.lr_scale": lr_scale,
            "fleetrl.rollback.groups_rewound": requeued,
        },
    )
