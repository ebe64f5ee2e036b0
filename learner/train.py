"""`fleetrl learner`: one learner rank's training loop (also under torchrun / the deepspeed launcher).

    learner = Learner(...)                     # models, DeepSpeed engine, batch source, publisher, checkpoints
    while not done:
        leased = source.next()                 # batch leases from the broker (dynamic sampling inside)
        stats = actor.step(batch, version)     # log-probs, advantages, clipped losses, optimizer step
        source.ack(leased, step)               # the broker may now forget (or commit) those groups
        publisher.publish(...)                 # every sync.interval steps: weights to the rollout fleet
        monitor.log(step, stats); checkpoint when due
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as tdist

from fleetrl.broker.client import BrokerClient, resolve_address, status_metrics
from fleetrl.common.config import load_config, save_resolved
from fleetrl.common.log import setup_logging
from fleetrl.common.schema import JobConfig
from fleetrl.learner.actor import Actor
from fleetrl.learner.batch import batch_from_groups
from fleetrl.learner.checkpoint import Checkpointer, export_hf, rng_state, set_rng_state
from fleetrl.learner.monitor import Monitor
from fleetrl.learner.runtime import (
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
from fleetrl.learner.source import BrokerBatchSource, Interrupted

log = logging.getLogger("fleetrl.learner")


class GracefulStop:
    """SIGTERM / SIGINT ask the loop to finish its step, checkpoint and exit 0."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            log.info("received %s: finishing this step, then checkpointing", signal.Signals(signum).name)
        self.requested = True

    def agreed(self, device: torch.device, also: bool = False) -> bool:
        """Stop only when every rank stops at the same step (collectives must match)."""
        local = self.requested or also
        if not tdist.is_initialized() or tdist.get_world_size() == 1:
            return local
        flag = torch.tensor([int(local)], device=device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return bool(flag.item())


class Learner:
    def __init__(self, cfg: JobConfig, run_dir: Path, client, dist: Dist):
        self.cfg, self.run_dir, self.client, self.dist = cfg, Path(run_dir), client, dist
        seed = cfg.learner.seed + dist.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        dtype = train_dtype(cfg, dist.device)
        self.engine, self.optimizer, self.scheduler = build_engine(load_causal_lm(cfg.model.path, cfg, dtype), cfg, dtype)
        ref = None
        if cfg.algorithm.kl.placement != "none":
            ref = build_frozen(load_causal_lm(cfg.model.path, cfg, dtype), cfg, dtype, dist.device)
        self.generator = torch.Generator().manual_seed(seed)
        self.actor = Actor(self.engine, ref, cfg, dist.device, self.generator)
        self.source = BrokerBatchSource(client, cfg, dist.rank, dist.world)
        self.ckpt = Checkpointer(cfg, run_dir, dist.rank)
        self.monitor = Monitor.for_run(run_dir, dist.rank)
        from fleetrl.learner.weights import WeightPublisher

        self.publisher = WeightPublisher(cfg, run_dir, dist.rank, param_specs(self.module))
        self.step = self.version = 0
        self.samples_seen = 0
        self.fleet_size = 0
        self.stop_requested: Callable[[], bool] = lambda: False
        self.evaluator = Evaluator(cfg) if dist.is_main and cfg.run.eval_interval and cfg.data.eval else None

    @property
    def module(self) -> torch.nn.Module:
        return trainable_module(self.engine)

    # ------------------------------------------------------------------ step
    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        leased = self.source.next(self.step + 1, self.stop_requested)
        batch = batch_from_groups(leased.groups)
        stats = self.actor.step(batch, self.version)
        self.step += 1
        self.source.ack(leased, self.step)
        if self.dist.is_main:
            stats.update(self.broker_metrics())
        if self.step % self.cfg.sync.interval == 0:
            stats.update(self.publish())
        if self.evaluator is not None and self.step % self.cfg.run.eval_interval == 0:
            stats.update(self.evaluator(self.module))
        wall = time.perf_counter() - t0
        self.samples_seen += batch.size
        stats.update({
            "timing/wait_batch_s": leased.wait_s, "timing/step_total_s": wall,
            "throughput/samples_per_s": batch.size / max(wall, 1e-9),
            "throughput/tokens_per_s": batch.num_tokens / max(wall, 1e-9),
            "batch/filtered_groups": float(leased.filtered), "batch/dropped_stale": float(leased.dropped_stale),
            "policy/version": float(self.version), "batch/samples_total": float(self.samples_seen),
        })
        return self._mean_over_ranks(stats)

    def broker_metrics(self) -> dict[str, float]:
        """The broker's queue and fleet, once per step (also sizes the next weight broadcast)."""
        status = self.client.status()
        self.fleet_size = sum(1 for c in status.clients if c.role == "rollout" and c.alive)
        return status_metrics(status)

    def _mean_over_ranks(self, stats: dict[str, float]) -> dict[str, float]:
        if self.dist.world == 1:
            return stats
        names = sorted(stats)
        t = torch.tensor([stats[n] for n in names], dtype=torch.float64, device=self.dist.device)
        tdist.all_reduce(t)
        return {n: float(v) / self.dist.world for n, v in zip(names, t.tolist())}

    # --------------------------------------------------------------- weights
    def publish(self) -> dict[str, float]:
        """Send the current weights to the rollout fleet as version ``version + 1`` (collective)."""
        self.version += 1
        expected = self.fleet_size
        announce = lambda info: self.client.publish_version(self.version, self.step, info)  # noqa: E731
        return self.publisher.publish(self.version, self.step, iter_full_params(self.module, self.cfg.learner.zero_stage),
                                      announce if self.dist.is_main else (lambda info: None), expected)

    # ----------------------------------------------------------- checkpoints
    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.interval
        return bool(every) and self.step % every == 0

    def save(self, healthy: bool = True) -> Path:
        state = {"step": self.step, "version": self.version, "rng": rng_state(), "generator": self.generator.get_state(),
                 "kl_ctl": self.actor.kl_ctl.state_dict(), "samples_seen": self.samples_seen,
                 "history": self.monitor.history[-200:]}
        export = lambda out: export_hf(self.module, iter_full_params(self.module, self.cfg.learner.zero_stage), out,  # noqa: E731
                                       self.cfg.model.tokenizer or self.cfg.model.path, self.dist.rank)
        path = self.ckpt.save(self.engine, self.step, state, {"version": self.version, "healthy": healthy}, export)
        if self.cfg.broker.commit_on_checkpoint:
            self.client.commit(self.step)
        return path

    def resume(self, path: Path) -> None:
        state = self.ckpt.load(self.engine, path)
        self.step, self.version, self.samples_seen = state["step"], state["version"], state.get("samples_seen", 0)
        set_rng_state(state["rng"])
        self.generator.set_state(state["generator"])
        self.actor.kl_ctl.load_state_dict(state["kl_ctl"])
        self.monitor.history = list(state.get("history", []))
        self.client.rewind(self.step)  # groups trained after the checkpoint come back, in order
        log.info("resumed from %s at step %d, policy version %d", path, self.step, self.version)
        if self.version:  # the fleet may hold newer weights than the checkpoint: send these again
            self.version -= 1
            self.publish()

    def close(self) -> None:
        self.monitor.close()
        self.publisher.close()


class Evaluator:
    """Greedy accuracy of the training model on the first run.eval_n rows of data.eval (rank 0)."""

    def __init__(self, cfg: JobConfig):
        from transformers import AutoTokenizer

        from fleetrl.learner.sft import read_rows

        self.rows = read_rows(cfg.data.eval)[: cfg.run.eval_n]
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
        self.max_new_tokens = cfg.rollout.max_new_tokens
        if cfg.learner.zero_stage == 3 or cfg.learner.num_ranks > 1:
            log.warning("periodic evaluation runs on rank 0 only and is skipped with ZeRO-3 or several ranks; "
                        "use `fleetrl eval` on a checkpoint's hf/ export instead")
            self.rows = []

    def __call__(self, module) -> dict[str, float]:
        if not self.rows:
            return {}
        from fleetrl.learner.sft import greedy_accuracy

        t0 = time.perf_counter()
        acc = greedy_accuracy(module, self.tokenizer, self.rows, self.max_new_tokens)
        return {"eval/accuracy": acc, "timing/eval_s": time.perf_counter() - t0}


def train(cfg: JobConfig, run_dir: Path, client=None, resume: str | None = None) -> int:
    """Run one learner rank until learner.total_steps (or a stop signal). Returns the exit code."""
    dist = init_distributed(cfg)
    own_client = client is None
    if own_client:
        client = connect_broker(cfg, run_dir, dist.rank)
    learner = Learner(cfg, run_dir, client, dist)
    stop = GracefulStop()
    try:
        path = learner.ckpt.resolve(resume or cfg.checkpoint.resume)
        if path is not None:
            learner.resume(path)
        write_ready(run_dir, dist, learner)
        if learner.evaluator is not None and learner.step == 0:
            learner.monitor.log(0, learner.evaluator(learner.module))  # the starting point of the curve
        deadline = time.monotonic() + 60 * cfg.learner.max_minutes if cfg.learner.max_minutes else float("inf")
        learner.stop_requested = lambda: stop.requested and dist.world == 1  # several ranks stop together, below
        while learner.step < cfg.learner.total_steps and not stop.agreed(dist.device, time.monotonic() > deadline):
            try:
                stats = learner.train_step()
            except Interrupted:
                break
            learner.monitor.log(learner.step, stats)
            if learner.checkpoint_due():
                learner.save()
        if not learner.ckpt.complete() or learner.ckpt.complete()[-1].name != f"step-{learner.step:08d}":
            learner.save()
        log.info("learner done at step %d (policy version %d)", learner.step, learner.version)
        return 0
    finally:
        learner.close()
        if own_client:
            client.close()


def connect_broker(cfg: JobConfig, run_dir: Path, rank: int) -> BrokerClient:
    """A registered client with a stable id per rank (the broker keys commits by it)."""
    client = BrokerClient(resolve_address(cfg.broker, run_dir), f"learner-{rank}", "learner", rank,
                          timeout_s=cfg.broker.request_timeout_s, curve=cfg.broker.curve,
                          info={"host": socket.gethostname(), "pid": str(os.getpid())})
    client.connect()
    return client


def write_ready(run_dir: Path, dist: Dist, learner: Learner) -> None:
    if dist.is_main:
        (Path(run_dir) / "learner.ready").write_text(f'{{"pid": {os.getpid()}, "step": {learner.step}}}')


def main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or cfg.run.dir or Path(cfg.run.root) / f"{cfg.run.name}-learner")
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(f"learner-{os.environ.get('RANK', '0')}", cfg.telemetry.log_level)
    if int(os.environ.get("RANK", 0)) == 0 and not (run_dir / "config.yaml").exists():
        save_resolved(cfg, run_dir)
    extra = ([f"broker.address={args.broker}"] if args.broker else []) + (
        [f"checkpoint.resume={args.resume}"] if args.resume else [])
    if extra:
        cfg = load_config(args.config, [*args.overrides, *extra])
    return train(cfg, run_dir)
