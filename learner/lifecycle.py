"""A learner rank's life around the training loop: joining the broker, reporting ready, stopping cleanly.

``connect_broker`` registers the rank under a stable client id (the broker keys commits and rewinds by
it); ``write_ready`` tells `fleetrl run` that rank 0 is up; ``GracefulStop`` turns SIGTERM / SIGINT
into a request to finish the current step, checkpoint and exit 0, agreed by every rank so that their
collectives stay matched; ``leave_broker`` is the last request: the rank leaves the fleet at once
(what it still holds is requeued), and rank 0 of a finished run says training is done.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

import torch
import torch.distributed as tdist

from fleetrl.broker.client.address import client_identity, resolve_address
from fleetrl.broker.client.roles import LearnerClient
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry.startup import STARTUP
from fleetrl.learner.runtime import BudgetClock, Dist

log = logging.getLogger("fleetrl.learner")


class GracefulStop:
    """SIGTERM / SIGINT ask the loop to finish its step, checkpoint and exit 0."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            log.info("received %s: finishing this step, then checkpointing", self.signal_name)
        self.requested = True

    def agreed(self, device: torch.device, clock: BudgetClock | None = None) -> bool:
        """Stop only when every rank stops at the same step (collectives must match): a signal, or ``clock``'s
        budget spent. The ranks agree on the clock's fraction too (the largest), so the LR it sets is the same
        on every rank."""
        spent = clock.local_fraction() if clock is not None else 0.0
        if tdist.is_initialized() and tdist.get_world_size() > 1:
            both = torch.tensor([float(self.requested), spent], dtype=torch.float64, device=device)
            tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
            requested, spent = bool(both[0].item()), float(both[1].item())
        else:
            requested = self.requested
        if clock is not None:
            clock.fraction = min(1.0, spent)
        return requested or spent >= 1.0


def connect_broker(cfg: JobConfig, run_dir: Path, rank: int) -> LearnerClient:
    """A registered client with a stable id per rank (the broker keys commits by it): ``<identity>-<rank>``,
    ``learner-<rank>`` with the default key name. It heartbeats, so that the broker sees the rank alive
    through long steps (a dead learner's rollback pause lifts by itself)."""
    identity = client_identity(cfg.broker.curve, "learner")
    client = ZmqBrokerClient(
        resolve_address(cfg.broker, run_dir),
        f"{identity}-{rank}",
        "learner",
        rank,
        timeout_s=cfg.broker.request_timeout_s,
        curve=cfg.broker.curve,
        info={"host": socket.gethostname(), "pid": str(os.getpid())},
    )
    reg = client.connect()
    client.start_heartbeat(lambda: (0, {}), reg.heartbeat_s or cfg.broker.heartbeat_s)
    STARTUP.mark("broker")
    return client


def leave_broker(client, reason: str, done: bool, is_main: bool) -> None:
    """Leave the fleet now; rank 0 with ``done`` tells the broker training is over (it announces `done`)."""
    try:
        client.leave(reason, done=done and is_main)
    except Exception as e:  # noqa: BLE001 - on the way out: the broker drops a silent client by itself
        log.info("could not tell the broker this learner leaves (%s); it drops it after broker.client_timeout_s", e)


def write_ready(run_dir: Path, dist: Dist, step: int) -> None:
    """Rank 0 writes ``<run dir>/learner.ready`` (pid and the step it starts from) for `fleetrl run`."""
    STARTUP.mark("setup")  # the objective, checkpoints, sinks, the weight publisher, a resume
    if dist.is_main:
        (Path(run_dir) / "learner.ready").write_text(f'{{"pid": {os.getpid()}, "step": {step}}}')
    log.info("%s", STARTUP.line())
