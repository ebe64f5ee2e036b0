"""`fleetrl learner`: one learner rank's training loop (also under torchrun / the deepspeed launcher).

learner = Learner(...)                     # model, DeepSpeed engine, the objective (OBJECTIVES), publisher
while not done:
    leased = source.next()                 # batch leases from the broker (dynamic sampling inside)
    batch = actor.plan(leased)             # packed once, on the device
    stats = actor.step(batch, version)     # log-probs, advantages / pairs, losses, optimizer step
    source.ack(leased, step)               # the broker may now forget (or commit) those groups
    publisher.publish(...)                 # every sync.interval steps: weights to the rollout fleet
    monitor.log(step, stats); checkpoint when due
leave the broker (`done` when training is over: rollouts started by hand then exit)
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch
import torch.distributed as tdist

from fleetrl.broker.client.metrics import expected_receivers, status_metrics
from fleetrl.common import faults
from fleetrl.common.config import load_config, save_resolved
from fleetrl.common.config.preflight import require_model_dir
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry import tracing
from fleetrl.common.telemetry.logs import setup_logging
from fleetrl.learner.checkpoint import Checkpointer, export_hf, rng_state, set_rng_state, tag_of
from fleetrl.learner.completions import CompletionLog, reward_part_metrics, sample_advantages
from fleetrl.learner.lifecycle import GracefulStop, connect_broker, leave_broker, write_ready
from fleetrl.learner.lora import AdapterFreeReference, apply_lora, export_merged, lora_param_specs, merged_params
from fleetrl.learner.monitor import Monitor
from fleetrl.learner.objectives import OBJECTIVES, Setup
from fleetrl.learner.peers import watch_peers
from fleetrl.learner.rollback import RollbackParts, roll_back
from fleetrl.learner.runtime import (
    BudgetClock,
    Dist,
    build_engine,
    build_frozen,
    init_distributed,
    iter_full_params,
    load_causal_lm,
    param_specs,
    train_dtype,
    trainable_module,
)
from fleetrl.learner.source import BrokerBatchSource, Interrupted, Prefetch
from fleetrl.learner.tracing import StepTraces

log = logging.getLogger("fleetrl.learner")


class Learner:
    def __init__(self, cfg: JobConfig, run_dir: Path, client, dist: Dist, evaluate_model=None):
        self.cfg, self.run_dir, self.client, self.dist = cfg, Path(run_dir), client, dist
        seed = cfg.learner.seed + dist.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        dtype = train_dtype(cfg, dist.device)
        self.lora, self.fleet = cfg.model.lora is not None, cfg.needs_fleet  # no fleet: offline DPO
        policy = load_causal_lm(cfg.model.path, cfg, dtype)
        if self.lora:  # only the adapters train (and sit in the optimizer)
            policy = apply_lora(policy, cfg.model.lora, cfg.model.gradient_checkpointing)
        self.clock = BudgetClock(cfg.learner.max_minutes)  # the training budget: deadline and lr_decay_by: time
        self.engine, self.optimizer, self.scheduler = build_engine(policy, cfg, dtype, clock=self.clock)
        self.generator = torch.Generator().manual_seed(seed)

        def load_reference():  # LoRA: the base with adapters off is the reference
            if self.lora:
                return AdapterFreeReference(self.module)
            return build_frozen(load_causal_lm(cfg.model.path, cfg, dtype), cfg, dtype, dist.device)

        objective = OBJECTIVES[cfg.algorithm.type](
            Setup(
                cfg,
                self.run_dir,
                client,
                dist,
                self.engine,
                dtype,
                self.generator,
                load_reference,
                evaluate_model,
                self.clock,
            )
        )
        self.actor, self.source, self.critic = objective.actor, objective.source, objective.critic
        self.evaluator = objective.evaluator
        self.ckpt = Checkpointer(cfg, run_dir, dist.rank)
        self.monitor = Monitor.for_run(run_dir, dist.rank, cfg=cfg)
        from fleetrl.common.weightsync.sender.publisher import WeightPublisher

        specs = lora_param_specs(self.module) if self.lora else param_specs(self.module)  # the base model's names
        self.publisher = WeightPublisher(cfg, run_dir, dist.rank, specs) if self.fleet else None
        self.step = self.version = 0
        self.saved_step: int | None = (
            None  # the step of the newest checkpoint saved or resumed (the same on every rank)
        )
        self.pristine = True  # the weights are exactly those published as `version` (no update since)
        self.samples_seen = 0
        self.fleet_size = 0
        # which groups each step trained (per rank); a resume marks the steps after it as replayed
        self.trained_log = JsonlLog(self.run_dir / f"trained-{dist.rank}.jsonl")
        self.stop_requested: Callable[[], bool] = lambda: False
        from fleetrl.learner.health import HealthMonitor

        self.health = (
            HealthMonitor(cfg.health, self.run_dir / "events.jsonl" if dist.is_main else None)
            if cfg.health.enabled
            else None
        )
        self.last_events: list = []  # the health events of the newest step
        idle = self.health.rollback_rules_without_checkpoints(cfg.checkpoint.interval) if self.health else []
        if idle and dist.is_main:
            log.warning(
                "%s roll back, but checkpoint.interval=0 saves no checkpoint to roll back to: they will alert "
                "instead, and non_finite will stop (set checkpoint.interval, e.g. 100, to let them act)",
                ", ".join(idle),
            )
        if self.health is not None and dist.is_main and hasattr(self.source, "on_refused"):
            health = self.health
            self.source.on_refused = lambda refused, why: health.note_refused(self.step + 1, refused, why)
        self.lr_scale = 1.0  # health.lr_factor ** rollbacks
        from fleetrl.learner.quarantine import FleetGuard

        self.guard = FleetGuard(
            self.health,
            self.source,
            client if self.fleet else None,
            dist,
            published=lambda v: self.publisher.fingerprints.get(v) if self.publisher is not None else None,
        )
        self.traces = StepTraces()
        self.completions = CompletionLog(cfg) if dist.is_main else None
        # with max_staleness 0 nothing can be leased before the publish it waits for: no prefetch
        leases = self.fleet and cfg.learner.prefetch and cfg.broker.max_staleness > 0
        leases = leases and isinstance(self.source, BrokerBatchSource)
        self.prefetch = Prefetch(self.source) if leases else None

    @property
    def module(self) -> torch.nn.Module:
        return trainable_module(self.engine)

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict[str, float]:
        t0, start_ns = time.perf_counter(), time.time_ns()
        if self.prefetch is not None:
            leased = self.prefetch.take(self.step + 1, self.version, self.stop_requested)
        else:
            leased = self.source.next(self.step + 1, self.stop_requested)
        fleet = self.guard.judge(self.step + 1, leased)  # per-server health: a poisoning server is quarantined
        with tracing.span(
            "learner.step", tracing.ROOT, {"fleetrl.step": self.step + 1}, tracing.group_links(leased.groups), start_ns
        ) as step_span:  # linked to every group
            batch = self.actor.plan(leased)
            if self.prefetch is not None and self.step + 2 <= self.cfg.learner.total_steps:
                # the next step's batch is leased while this one trains, at the version it will train at
                publishes = (self.step + 1) % self.cfg.sync.interval == 0
                self.prefetch.start(self.step + 2, self.version + int(publishes), self.stop_requested, leased.groups)
            with faults.around("learner.update", learner=self, step=self.step + 1):
                stats = self.actor.step(batch, self.version, self.pristine)
            self.pristine = False
            self.step += 1
            self.source.ack(leased, self.step)
            if self.prefetch is not None:
                self.prefetch.step_acked()
            self.traces.trained(step_span, leased.groups, self.step, self.version, start_ns)  # learner/tracing.py
            self.trained_log.write(
                {
                    "step": self.step,
                    "version": self.version,
                    "group_ids": leased.ids,
                    **({"filtered_ids": leased.filtered_ids} if leased.filtered_ids else {}),
                    **({"screened_ids": leased.screened_ids} if leased.screened_ids else {}),
                }
            )
            main_only = self.broker_metrics() if self.dist.is_main and self.fleet else {}  # sizes the broadcast
            main_only.update(fleet)
            if self.dist.is_main:  # per reward function (rank 0's groups: keys may differ between ranks)
                main_only.update(reward_part_metrics(leased.groups))
                if self.completions is not None and self.completions.due(self.step) and leased.groups:
                    self.monitor.log_completions(
                        self.step, self.completions.rows(self.step, leased.groups, sample_advantages(batch))
                    )
            if self.fleet and self.step % self.cfg.sync.interval == 0 and finite_update(stats):
                main_only.update(self.publish(overlap=True))
            if self.evaluator is not None and self.step % self.cfg.run.eval_interval == 0:
                main_only.update(self.evaluator(self.module))
            wall = time.perf_counter() - t0
            samples = int(stats["batch/samples"])
            self.samples_seen += samples
            stats.update(
                {
                    "timing/wait_batch_s": leased.wait_s,
                    "timing/lease_s": leased.lease_s,
                    "timing/step_total_s": wall,
                    "throughput/samples_per_s": samples / max(wall, 1e-9),
                    "throughput/tokens_per_s": stats["batch/tokens"] / max(wall, 1e-9),
                    "batch/filtered_groups": float(leased.filtered),
                    "batch/dropped_stale": float(leased.dropped_stale),
                }
            )
            stats = self._mean_over_ranks(stats)  # every rank has the same keys here
            stats.update(main_only)
            stats.update(
                {
                    "policy/version": float(self.version),
                    "batch/samples_total": float(self.samples_seen * self.dist.world),
                }
            )
            return stats

    def broker_metrics(self) -> dict[str, float]:
        """The broker's queue and fleet, once per step (also sizes the next weight broadcast)."""
        status = self.client.status()
        self.fleet_size = expected_receivers(status)
        return status_metrics(status)

    def _mean_over_ranks(self, stats: dict[str, float]) -> dict[str, float]:
        """Average metrics over ranks (sums for throughput and batch sizes); keys must match on every rank."""
        if self.dist.world == 1:
            return stats
        names = sorted(stats)
        t = torch.tensor([stats[n] for n in names], dtype=torch.float64, device=self.dist.device)
        tdist.all_reduce(t)
        summed = ("throughput/", "batch/samples", "batch/groups", "batch/tokens", "batch/filtered", "batch/dropped")
        return {n: float(v) / (1 if n.startswith(summed) else self.dist.world) for n, v in zip(names, t.tolist())}

    # --------------------------------------------------------------- weights
    def publish(self, overlap: bool = False) -> dict[str, float]:
        """Send the current weights to the rollout fleet as version ``version + 1`` (collective). ``overlap``
        (a training step's publish, with ``sync.overlap``): return once it is announced, the round streams
        beside the next step (common/weightsync/sender/publisher.py); otherwise the round is over on return."""
        self.version += 1
        self.pristine = True
        expected = self.fleet_size
        version, step = self.version, self.step  # the round's thread may announce after these move on
        with self.traces.publishing(version, step) as traces:  # spans in the trained groups' traces
            announce = lambda info: self.client.publish_version(  # noqa: E731
                version, step, msgspec.structs.replace(info, traces=traces)
            )
            args = (version, step, self.full_params(), announce if self.dist.is_main else (lambda info: None), expected)
            if overlap:
                return self.publisher.start(*args)
            self.publisher.wait()  # a round still in flight goes first: versions reach the fleet in order
            return self.publisher.publish(*args)

    def full_params(self):
        """(name, full tensor) under the base model's names; with model.lora the merged weights (collective)."""
        return merged_params(self.module) if self.lora else iter_full_params(self.module, self.cfg.learner.zero_stage)

    # ----------------------------------------------------------- checkpoints
    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.interval
        return bool(every) and self.step % every == 0

    def save(self) -> Path:
        healthy = self.health.on_checkpoint(self.step) if self.health is not None else True
        state = {
            "step": self.step,
            "version": self.version,
            "rng": rng_state(),
            "generator": self.generator.get_state(),
            "actor": self.actor.state_dict(),
            "samples_seen": self.samples_seen,
            "history": self.monitor.history[-200:],
            "lr_scale": self.lr_scale,
            "health": self.health.state_dict() if self.health is not None else None,
            "source": self.source.state_dict(),
        }
        tokenizer = self.cfg.model.tokenizer or self.cfg.model.path
        export = (
            (lambda out: export_merged(self.module, out, tokenizer, self.dist.rank))
            if self.lora
            else (lambda out: export_hf(self.module, self.full_params(), out, tokenizer, self.dist.rank))
        )
        extra = self.critic.save if self.critic is not None else None  # <checkpoint>/critic/
        path = self.ckpt.save(
            self.engine, self.step, state, {"version": self.version, "healthy": healthy}, export, extra
        )
        self.saved_step = self.step
        if self.cfg.broker.commit_on_checkpoint and self.fleet:
            self.client.commit(self.step)
        return path

    def resume(self, path: Path) -> None:
        state = self.ckpt.load(self.engine, path)
        self.step, self.version, self.samples_seen = state["step"], state["version"], state.get("samples_seen", 0)
        self.saved_step = self.step
        set_rng_state(state["rng"])
        self.generator.set_state(state["generator"])
        self.actor.load_state_dict(state["actor"])
        self.monitor.history = list(state.get("history", []))
        self.lr_scale = state.get("lr_scale", 1.0)
        if self.health is not None and state.get("health") is not None:
            self.health.load_state_dict(state["health"])
            self.guard.restore()
        if self.critic is not None:
            self.critic.load(path)
        self.source.load_state_dict(state.get("source", {}))
        if not self.fleet:
            log.info("resumed from %s at step %d", path, self.step)
            return
        self.client.rewind(self.step)  # groups trained after the checkpoint come back, in order
        self.trained_log.write({"resume": self.step, "time": time.time()})
        # The fleet may hold newer weights than the checkpoint's: publish these as a version newer than
        # any the broker has seen, so versions never go backwards across a learner restart.
        newest = self.client.current_version().version if self.dist.is_main else 0
        self.version = max(self.version, self._max_over_ranks(newest))
        if self.dist.is_main:
            self.broker_metrics()  # the round waits for the rollouts registered now (more join by catch-up rounds)
        log.info(
            "resumed from %s at step %d; publishing its weights as policy version %d", path, self.step, self.version + 1
        )
        self.publish()

    def _max_over_ranks(self, value: int) -> int:
        if self.dist.world == 1:
            return value
        t = torch.tensor([value], device=self.dist.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return int(t.item())

    def rollback(self, reason: str) -> bool:
        """Restore the newest healthy checkpoint with a lower LR; False if there is none (then alert or stop).
        The steps, in order, are in ``learner/rollback.py``."""
        if self.prefetch is not None:  # leased for a step that will not follow this one
            self.prefetch.cancel(self.step)
        parts = RollbackParts(
            self.cfg,
            self.ckpt,
            self.engine,
            self.actor,
            self.critic,
            self.generator,
            self.source,
            self.health,
            self.client,
            self.dist,
            self.trained_log,
            self.fleet,
            self.step,
            self.version,
            publish=self.publish_new_version,
            set_lr_scale=self.set_lr_scale,
        )
        return roll_back(parts, reason)

    def publish_new_version(self) -> int:
        """``publish``, returning the policy version it published."""
        self.publish()
        return self.version

    def set_lr_scale(self, scale: float) -> None:
        """Scale the schedule's base LR (kept by the scheduler's state) and the current LR by ``scale``."""
        self.lr_scale = scale
        peak = self.cfg.learner.lr * self.lr_scale
        self.scheduler.base_lrs = [peak for _ in self.scheduler.base_lrs]
        factor = (
            self.scheduler.lr_lambdas[0](self.scheduler.last_epoch) if hasattr(self.scheduler, "lr_lambdas") else 1.0
        )
        for group in self.optimizer.param_groups:
            group["lr"] = peak * factor

    def check_health(self, stats: dict[str, float]) -> str:
        """Feed the monitor; returns the action to take now: none | alert | rollback | stop."""
        if self.health is None:
            return "none"
        events = self.last_events = self.health.observe(self.step, stats)
        stats.update(self.health.metrics([*events, *self.guard.pop_events()]))
        for step in self.health.pop_revoked():
            self.ckpt.mark_healthy(self.ckpt.dir / tag_of(step), False)
        return self.health.decide(events)

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close(self.step)
        self.monitor.close()
        if self.publisher is not None:
            self.publisher.close()


def finite_update(stats: dict[str, float]) -> bool:
    """Whether the step's loss and grad norm are finite; weights from a step that is not are never published
    (the fleet would sample from NaN weights while the health monitor decides)."""
    ok = all(math.isfinite(stats.get(k, 0.0)) for k in ("actor/loss", "actor/grad_norm"))
    if not ok:
        log.error("step loss or grad norm is not finite: these weights are not published to the fleet")
    return ok


class JsonlLog:
    """Append-only JSON lines, flushed per line (survives a SIGKILL of this process)."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


def train(cfg: JobConfig, run_dir: Path, client=None, resume: str | None = None, evaluate_model=None) -> int:
    """Run one learner rank until learner.total_steps (or a stop signal). Returns the exit code.

    ``evaluate_model``: the held-out evaluator (``learner/evaluate.py``), handed in by the application."""
    dist = init_distributed(cfg)
    peers = watch_peers(cfg.learner.peer_timeout_s, dist.rank, dist.world)  # a rank cut off fails fast, named
    tracing.setup_tracing(
        "learner", cfg.telemetry, run_dir, {"service.instance.id": f"learner-{dist.rank}", "fleetrl.rank": dist.rank}
    )
    own_client = client is None and cfg.needs_fleet  # offline DPO runs without a broker
    if own_client:
        client = connect_broker(cfg, run_dir, dist.rank)
    learner = Learner(cfg, run_dir, client, dist, evaluate_model)
    stop = GracefulStop()
    ending = ("error", False)  # (why this rank leaves the broker, whether training is done)
    try:
        path = learner.ckpt.resolve(resume or cfg.checkpoint.resume)
        if path is not None:
            learner.resume(path)
        write_ready(run_dir, dist, learner.step)
        if learner.evaluator is not None and learner.step == 0:
            learner.monitor.log(0, learner.evaluator(learner.module))  # the starting point of the curve
        learner.clock.start()  # learner.max_minutes counts from here (after a resume too)
        learner.stop_requested = lambda: stop.requested and dist.world == 1  # several ranks stop together, below
        while learner.step < cfg.learner.total_steps and not stop.agreed(dist.device, learner.clock):
            try:
                stats = learner.train_step()
            except Interrupted:
                break
            action = learner.check_health(stats)
            learner.monitor.log(learner.step, stats)
            if action == "rollback" and not learner.rollback(f"rule fired at step {learner.step}"):
                action = learner.health.rollback_unavailable(learner.step, learner.last_events, cfg.checkpoint.interval)
            if action == "stop":
                log.error("health monitor stops the run at step %d:\n%s", learner.step, learner.health.report())
                final = learner.save()
                ending = (f"the health monitor stopped the run at step {learner.step}", True)
                log.info(
                    "learner stopped by the health monitor at step %d (policy version %d); final checkpoint %s",
                    learner.step,
                    learner.version,
                    final.name,
                )
                return 3
            if learner.checkpoint_due():
                learner.save()
        # whether this step is saved already, from the learner's own record: the files on disk are not the same
        # on every rank at this moment (rank 0 writes meta.json after the others have left the save), and a rank
        # that saved alone would wait in DeepSpeed's save barrier for ranks that have left
        final = learner.save() if learner.saved_step != learner.step else learner.ckpt.dir / tag_of(learner.step)
        if stop.requested:
            ending = (f"stopped by {stop.signal_name} at step {learner.step}", False)
            log.info(
                "learner stopped (%s) at step %d (policy version %d); final checkpoint %s",
                stop.signal_name,
                learner.step,
                learner.version,
                final.name,
            )
        else:
            ending = (f"training finished at step {learner.step}", True)
            log.info(
                "learner done at step %d (policy version %d); final checkpoint %s",
                learner.step,
                learner.version,
                final.name,
            )
        return 0
    finally:
        if peers is not None:
            peers.stop()
        learner.close()
        if learner.fleet and client is not None:
            leave_broker(client, *ending, is_main=dist.is_main)
        if own_client:
            client.close()


def main(args, evaluate_model=None) -> int:
    """`fleetrl learner` (``app/entries.py`` calls it with rollout's evaluator)."""
    cfg = load_config(args.config, args.overrides)
    require_model_dir(cfg.model.path)
    run_dir = Path(args.run_dir or cfg.run.dir or Path(cfg.run.root) / f"{cfg.run.name}-learner")
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(f"learner-{os.environ.get('RANK', '0')}", cfg.telemetry.log_level)
    if int(os.environ.get("RANK", 0)) == 0 and not (run_dir / "config.yaml").exists():
        save_resolved(cfg, run_dir)
    extra = ([f"broker.address={args.broker}"] if args.broker else []) + (
        [f"checkpoint.resume={args.resume}"] if args.resume else []
    )
    if extra:
        cfg = load_config(args.config, [*args.overrides, *extra])
    return train(cfg, run_dir, evaluate_model=evaluate_model)
