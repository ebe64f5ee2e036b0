"""The circuit breaker's rollback: put the learner and the fleet back on the newest healthy checkpoint.

    pause the fleet → restore model, optimizer, scheduler, RNG and the data cursor → LR × health.lr_factor
    → the abandoned branch's groups: rewound, and those of the rolled-back versions discarded at the broker
    → publish the restored weights as a new version → resume the fleet → the event on the timeline

After it, no group with a token sampled by a rolled-back version reaches the learner: the broker drops
the queued ones and every late arrival (``broker/control.py``, ``broker/queue.py`` ``touches``), and the
rollout servers load the restored weights before they lease again (the publish precedes the resume).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch.distributed as tdist

from fleetrl.common.telemetry import tracing
from fleetrl.learner.checkpoint import set_rng_state, tag_of

if TYPE_CHECKING:
    from fleetrl.learner.train import Learner

log = logging.getLogger("fleetrl.learner")


def roll_back(lr: "Learner", reason: str) -> bool:
    """Restore the newest healthy checkpoint; False if there is none (the caller alerts, or stops the run).

    The learner keeps counting steps forward (the abandoned steps stay in the logs) and publishes the
    restored weights as a version newer than every rolled-back one, so versions never go back.
    """
    start_ns = time.time_ns()
    steps = [int(path.name.split("-")[1]) for path in lr.ckpt.complete()]
    target_step = lr.health.rollback_target(steps)
    if target_step is None:
        return False  # the caller decides what then (HealthMonitor.rollback_unavailable)
    target = lr.ckpt.dir / tag_of(target_step)
    for step in steps:
        if step > target_step:  # the abandoned timeline's checkpoints are never rollback targets
            lr.ckpt.mark_healthy(lr.ckpt.dir / tag_of(step), False)
    main = lr.dist.is_main and lr.fleet
    if main:
        lr.client.control("pause", reason=f"rollback: {reason}")
    state = lr.ckpt.load(lr.engine, target)  # model, optimizer, scheduler
    if lr.critic is not None:
        lr.critic.load(target)
    bad_from, bad_to = state["version"] + 1, lr.version
    restore_state(lr, state)
    requeued = discard_abandoned(lr, target.name, target_step, bad_from, bad_to) if lr.fleet else 0
    lr.health.record_rollback(to_step=state["step"], from_step=lr.step)
    lr.health.rewind_to(state.get("health"), state["step"])
    if lr.fleet:
        lr.publish()  # the restored weights, as a version newer than every rolled-back one
    if main:
        lr.client.control("resume", reason="rollback done")
    record_timeline(lr, start_ns, reason, target_step, state["version"], bad_from, bad_to, requeued)
    log.warning("health: rolled back to %s (policy version %d), lr x%.3g, discarded versions %d..%d, published "
                "version %d: %s", target.name, state["version"], lr.lr_scale, bad_from, bad_to, lr.version, reason)
    return True


def restore_state(lr: "Learner", state: dict) -> None:
    """Actor state, RNG streams and the data cursor as they were at the checkpoint; the LR lowered."""
    lr.actor.load_state_dict(state["actor"])
    set_rng_state(state["rng"])
    lr.generator.set_state(state["generator"])
    lr.source.load_state_dict(state.get("source", {}))
    lr.lr_scale = state.get("lr_scale", 1.0) * lr.cfg.health.lr_factor
    lr._apply_lr_scale()


def discard_abandoned(lr: "Learner", name: str, target_step: int, bad_from: int, bad_to: int) -> int:
    """The broker forgets the abandoned branch: with ``broker.commit_on_checkpoint`` every rank's groups
    trained since the checkpoint come back first (the data cursor rewinds to the checkpoint's); then,
    once every rank has rewound, rank 0 has every group with a token from versions ``[bad_from, bad_to]``
    dropped (those that just came back included), its prompt issued again, and late arrivals from those
    versions refused. Returns how many of this rank's groups came back."""
    back = 0
    if lr.cfg.broker.commit_on_checkpoint:
        back = lr.client.rewind(target_step).count
    if lr.dist.world > 1:
        tdist.barrier()  # the discard must see every rank's rewound groups
    if lr.dist.is_main:
        lr.client.control("discard", reason=f"rollback to {name}", min_version=bad_from, max_version=bad_to)
    return back


def record_timeline(lr: "Learner", start_ns: int, reason: str, target_step: int, version: int, bad_from: int,
                    bad_to: int, requeued: int) -> None:
    """The rollback in the trained log (``trained-<rank>.jsonl``) and as a ``learner.rollback`` span (a root:
    it belongs to no group's trace); the events.jsonl line is ``HealthMonitor.record_rollback``'s."""
    lr.trained_log.write({"rollback": lr.step, "to_step": target_step, "restored_version": version,
                          "discarded": [bad_from, bad_to], "published_version": lr.version, "time": time.time()})
    tracing.record_span("learner.rollback", start_ns, parent=tracing.ROOT, attributes={
        "fleetrl.step": lr.step, "fleetrl.rollback.to_step": target_step, "fleetrl.rollback.reason": reason,
        "fleetrl.rollback.restored_version": version, "fleetrl.rollback.discarded_min_version": bad_from,
        "fleetrl.rollback.discarded_max_version": bad_to, "fleetrl.policy_version": lr.version,
        "fleetrl.rollback.lr_scale": lr.lr_scale, "fleetrl.rollback.groups_rewound": requeued})
