"""`fleetrl rollout`: one rollout server, a stream rather than a batch loop (docs/rollout.md).

    start:  load the engine → register with the broker (heartbeats from then on) → subscribe to
            announcements → `<run-dir>/rollout-<i>.ready`
    loop:   announcements and new weights → lease prompts while fewer than `rollout.max_inflight`
            are in flight → the lease to the engine's event loop in one call, where each prompt runs
            its `group_size` episodes and, the moment they are all done, its group is assembled and
            its rewards started (inline or scorer threads) → one SampleGroup → pushed until acked with
            whatever else is ready (the finisher thread, `loop.py`)

Threads: this control loop (the main thread); the engine's event loop, which also carries the
broker client and each prompt's pipeline (`_pipeline`); the hf decode thread; the finisher; reward
workers for rewards with a time limit; the weight receiver (docs/rollout.md, "Threads and loops").
    stop:   SIGTERM / SIGINT / a `stop` or `done` announcement / data exhausted: admit nothing more,
            finish the groups in flight, push, return every prompt still leased, leave the fleet,
            exit 0 (`done`: unless rollout.stay_after_done). A second signal abandons the groups in
            flight (their prompts are returned too).

New weights are loaded in flight (`Engine.swap_weights`: pause → load → resume, as
`rollout.inflight_update` says); every token records the version that sampled it and a group's
`policy_version` is its oldest. Missed announcements (PUB/SUB drops messages for late joiners) are
caught up by asking the broker for its current version every `CATCHUP_S` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetrl.broker.client.address import client_identity, default_client_id, resolve_address
from fleetrl.broker.client.errors import BrokerError, BrokerUnauthorized, BrokerUnavailable
from fleetrl.broker.client.roles import RolloutClient, SubscriptionLike
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.common import faults
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.common.config.preflight import require_model_dir
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.telemetry import tracing
from fleetrl.common.telemetry.logs import setup_logging
from fleetrl.common.telemetry.resources import ProcessResources
from fleetrl.common.telemetry.startup import STARTUP
from fleetrl.rollout.apply import WeightApplier
from fleetrl.rollout.assembly import GroupAssembly
from fleetrl.rollout.engines import Generation, SamplingParams, create_engine
from fleetrl.rollout.envs import Environment, create_env
from fleetrl.rollout.fleet import exits_on_done, is_done_throttle, leave_fleet
from fleetrl.rollout.inflight import InFlight, InflightBudget, trace_carrier
from fleetrl.rollout.loop import Batch, Finisher, MetricsFile, OpenLeases, Stats, return_leases
from fleetrl.rollout.rewards.scorer import RewardScorer, RewardsHopeless
from fleetrl.rollout.tracing import LeaseTrace

if TYPE_CHECKING:
    from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

log = logging.getLogger("fleetrl.rollout")

EXIT_BROKER_UNAVAILABLE = 3
EXIT_REWARDS_HOPELESS = (
    4  # rollout.reward_stop_after samples in a row unusable: a restart cannot help (`fleetrl run` does not)
)
CATCHUP_S = 5.0  # seconds between GetVersion polls (catch-up for dropped announcements and pause state)
WAIT_SLICE_S = 0.25  # longest sleep without looking at announcements and the stop flag
POLL_SLICE_S = 0.05  # while samples are generating: how often announcements are looked at
PAUSED_POLL_S = 0.5  # while paused: how often the loop looks again (announcements wake it earlier)
THROTTLE_S = (0.05, 5.0)  # bounds on a Throttle's retry_after_s
# the main loop not polling for this long (it polls at least every WAIT_SLICE_S) is logged once, with every
# thread's stack: a stalled loop takes no weights and no prompts while its heartbeat says it is alive
STALL_S = 120.0


class Abort(BaseException):
    """A second SIGTERM / SIGINT: abandon the groups in flight (their prompts are returned)."""


class RolloutServer:
    """The loop of one rollout server over a broker client (socket or in-process twin).

    Takes a connected-or-not client, a built engine and scorer, and optionally a weight receiver;
    ``run()`` registers, loops until stopped and returns the exit code. It closes none of them.
    """

    def __init__(
        self,
        cfg: JobConfig,
        client: RolloutClient,
        engine: Any,
        scorer: RewardScorer,
        *,
        server_index: int = 0,
        run_dir: str | Path | None = None,
        receiver: WeightReceiver | None = None,
        stop_event: threading.Event | None = None,
        env: Environment | None = None,
        endpoint: Any = None,
    ):
        self.cfg, self.client, self.engine, self.scorer, self.receiver = cfg, client, engine, scorer, receiver
        # how each sample is produced (rollout.env); built and checked here unless the caller brings one
        self.env = env if env is not None else create_env(cfg, engine.tokenizer)
        self.endpoint = endpoint  # the OpenAI-compatible endpoint (rollout.openai), served while the server runs
        self.server_index, self.client_id = server_index, client.client_id
        self.run_dir = Path(run_dir) if run_dir else None
        self.params = SamplingParams.from_config(cfg.rollout)
        # ReMax's baseline: one greedy response per prompt, scored with the group (its reward rides along)
        self.greedy_baseline = getattr(cfg.algorithm, "adv_estimator", None) == "remax"
        self.greedy_params = dataclasses.replace(self.params, temperature=0.0, seed=None)
        self.budget = InflightBudget(cfg)  # admission on this side: rollout.max_inflight prompts unpushed
        self.weights = WeightApplier(cfg, engine, receiver, on_loaded=self._loaded)  # the engine's version
        self.assembly = GroupAssembly(cfg, self.env, scorer, self.client_id, self.params, self.greedy_baseline)
        self.paused = False
        self.stop_reason = ""
        self.closing = False  # set by shutdown(): failures of what is still in flight are expected from then on
        self._stop = stop_event or threading.Event()
        self.leases, self.stats = OpenLeases(), Stats()
        self.metrics = MetricsFile(self.run_dir / f"rollout-{server_index}.metrics.jsonl" if self.run_dir else None)
        self.sub: SubscriptionLike | None = None
        self.finisher: Finisher | None = None
        self.inflight: dict[int, InFlight] = {}  # admitted, not yet handed to the finisher (removed on the engine loop)
        self.pipeline_error: BaseException | None = None  # what a prompt's pipeline raised (the server raises it)
        self._wake = threading.Event()
        if receiver is not None and hasattr(receiver, "on_ready"):  # vLLM's workers hold theirs: polled
            receiver.on_ready = self._weights_ready
        self.announced = 0  # version announcements seen: a throttled lease asks again after one (`lease`)
        self._next_id = 0
        self._next_catchup = 0.0
        self._polled, self._stall_logged = time.monotonic(), False
        self._told_done = False
        self.resources = ProcessResources("resource/rollout")

    @property
    def version(self) -> int:
        """The weights the engine holds (model.path until a new version is applied)."""
        return self.weights.version

    # ------------------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        """Register, loop until stopped, shut down. Raises BrokerUnavailable when the broker is gone."""
        finish, give_back = False, True
        try:
            if not self.stopping:
                self.start()
            while not self.stopping:
                self.step()
            finish = True
        except BrokerUnavailable:
            give_back = False  # nobody to give them to; the broker re-issues them when they expire
            raise
        finally:
            self.shutdown(finish, give_back)
        if self.finisher is not None and self.finisher.error is not None:
            raise self.finisher.error  # the last groups could not be pushed: not a clean exit
        if self.pipeline_error is not None:
            raise self.pipeline_error
        return 0

    def start(self) -> None:
        STARTUP.mark("receiver")
        reg = self.client.connect()
        self.sub = self.client.subscribe()
        self.client.start_heartbeat(self.heartbeat_stats, reg.heartbeat_s or self.cfg.broker.heartbeat_s)
        push_deadline = max(self.cfg.broker.prompt_lease_s, 3 * self.cfg.broker.request_timeout_s)
        self.finisher = Finisher(
            self.client,
            self.scorer,
            self.client_id,
            self.leases,
            self.stats,
            self.metrics,
            push_deadline,
            self.batch_stats,
            on_done=self._pushed,
            fingerprint=lambda: self.weights.fingerprint,
        )
        STARTUP.mark("broker")
        self.on_current(reg.policy_version, reg.weights, reg.paused)
        STARTUP.mark("initial policy")
        self._next_catchup = time.monotonic() + CATCHUP_S
        if self.endpoint is not None:
            self.endpoint.start()
        if self.run_dir is not None:
            write_ready(self.run_dir, self.server_index, self.client_id, self.version)
        log.info("%s", STARTUP.line())
        log.info(
            "ready: %s registered with broker %s (broker at version %d%s), up to %d prompts x %d samples "
            "in flight, in-flight updates: %s",
            self.client_id,
            reg.broker_id,
            reg.policy_version,
            ", paused" if reg.paused else "",
            self.budget.most,
            self.cfg.rollout.group_size,
            self.cfg.rollout.inflight_update,
        )

    def step(self) -> m.PromptLease | None:
        """One iteration: announcements and weights, admit prompts up to the budget, hand finished
        groups to the finisher; waits a little when nothing could be admitted. Returns the lease admitted."""
        self.poll(0.0)
        lease = None
        if self.room() >= self.budget.lease_floor():
            start_ns = time.time_ns()
            lease = self.lease(min(self.room(), self.cfg.rollout.prompts_per_batch))
            if lease is not None:
                self.generate(lease, LeaseTrace.start(lease, self.client_id, self.version, start_ns))
        if lease is None and not self.stopping:
            self.wait_progress(WAIT_SLICE_S)
        return lease

    def shutdown(self, finish: bool, give_back: bool) -> None:
        self.closing = True
        self.env.begin_stop()
        if finish:
            try:
                self.drain_inflight()
            except Abort:
                finish = False
        if self.finisher is not None:
            if finish:
                self.finisher.close()
                if isinstance(self.finisher.error, BrokerUnavailable):
                    give_back = False
            else:
                self.finisher.abandon()
        if self.endpoint is not None:
            self.endpoint.close()
        self.env.close()  # its HTTP client and threads; nothing of it is needed after the drain
        if give_back and len(self.leases):
            n = return_leases(self.client, self.leases, self.stats)
            log.info("returned %d leased prompt(s) to the broker, which re-issues them", n)
        t = self.stats.heartbeat()
        reason = self.stop_reason or ("stop requested" if self.stopping else "error")
        if give_back and self.finisher is not None:  # registered and the broker answers: leave the fleet now
            leave_fleet(self.client, reason)
        log.info(
            "stopped (%s): %d groups pushed, %d dropped, %d prompts returned",
            reason,
            t["rollout/groups_pushed"],
            t["rollout/groups_dropped"],
            t["rollout/prompts_returned"],
        )

    def drain_inflight(self) -> None:
        """Finish every admitted group (no new admissions): the graceful half of a stop."""
        if self.inflight:
            log.info("finishing %d group(s) in flight before stopping", len(self.inflight))
        while self.inflight:
            self._wake.wait(WAIT_SLICE_S)
            self._wake.clear()
            if self.pipeline_error is not None or (self.finisher is not None and self.finisher.error is not None):
                return  # run() raises it once the server has shut down

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            log.info("stopping (%s): finishing the groups in flight", reason)
            self._stop.set()

    # ------------------------------------------------------------------------------ the loop

    def room(self) -> int:
        """Prompts that may still be admitted (0 while paused or stopping)."""
        return 0 if self.paused or self.stopping else self.budget.room()

    def lease(self, n: int | None = None) -> m.PromptLease | None:
        """Up to ``n`` prompts (default prompts_per_batch), or None after waiting (paused, throttled, stopping)."""
        if self.paused:
            self.wait(PAUSED_POLL_S)
            return None
        faults.at("rollout.idle")
        try:
            reply = self.client.lease_prompts(n or self.cfg.rollout.prompts_per_batch, self.version)
        except BrokerError as e:
            if e.code != "data_exhausted":
                raise
            self.request_stop(f"data exhausted: {e.reason}")
            return None
        if isinstance(reply, m.Throttle):
            if reply.reason == "stopping":  # a `stop` whose announcement this server missed
                self.request_stop("the broker is stopping")
                return None
            if is_done_throttle(reply.reason):  # a `done` whose announcement this server missed
                self.on_job_done(reply.reason.partition(": ")[2])
            t0, seen = time.monotonic(), (self.version, self.announced)
            # a new version frees admission (the learner acks its batch before it publishes) or lets this
            # server's lag shrink: ask again then rather than sleep out the retry (issue 24)
            wakes = reply.reason.startswith("at capacity") or "load new weights" in reply.reason
            until = (lambda: (self.version, self.announced) != seen) if wakes else None
            self.wait(min(max(reply.retry_after_s, THROTTLE_S[0]), THROTTLE_S[1]), until)
            self.stats.throttled(time.monotonic() - t0)
            log.debug("throttled by the broker: %s", reply.reason)
            return None
        self.leases.add(reply)
        return reply

    def generate(self, lease: m.PromptLease, trace: LeaseTrace | None = None) -> list[InFlight]:
        """Admit the lease's prompts: ``group_size`` episodes each (rollout.env; single_turn: one request),
        handed to the engine's event loop in one call, where each prompt runs on to its push (`_pipeline`)."""
        g = self.cfg.rollout.group_size
        n = g + int(self.greedy_baseline)  # the last sample of a group is the greedy baseline (remax)
        admitted = []
        faults.at("rollout.generate")
        for prompt in lease.prompts:
            task = self.env.task(prompt)
            key, self._next_id = self._next_id, self._next_id + 1
            item = InFlight(lease, prompt, task.prompt_ids, self.version, time.monotonic(), trace, [None] * n)
            self.inflight[key] = item
            self.budget.admitted()
            episodes = []
            for j in range(n):
                params = (
                    self.greedy_params if j == g else faults.at("rollout.sampling", self.params, version=self.version)
                )
                episodes.append(
                    self.env.episode(
                        self.engine, task, params, f"{self.client_id}/{key}/{j}", trace_carrier(trace, prompt.prompt_id)
                    )
                )
            admitted.append((key, item, episodes))
        self.engine.loop.submit(self._pipeline(admitted))
        return [item for _, item, _ in admitted]

    async def _pipeline(self, admitted: list[tuple[int, InFlight, list]]) -> None:
        """On the engine's event loop: each prompt's episodes, then its group is assembled and its rewards
        started (scorer), and it goes to the finisher for the push; no thread hand-off per sample."""
        await asyncio.gather(*(self._prompt(key, item, episodes) for key, item, episodes in admitted))

    async def _prompt(self, key: int, item: InFlight, episodes: list) -> None:
        for j, sample in enumerate(await asyncio.gather(*episodes, return_exceptions=True)):
            if isinstance(sample, BaseException):  # the engine failed this request: the prompt goes back
                item.failed = item.failed or sample
                sample = Generation([], [], "stop", "")
            item.samples[j] = sample
        try:
            self._finished(key, item)
        except BaseException as e:  # noqa: BLE001 - raised on the server's thread (poll)
            self.pipeline_error = self.pipeline_error or e
        self._wake.set()

    def _finished(self, key: int, item: InFlight) -> None:
        del self.inflight[key]
        if item.failed is not None:
            # while the server shuts down, the closing engine fails what is in flight: expected, not an error
            log.log(
                logging.DEBUG if self.closing else logging.ERROR,
                "generation failed for prompt %s (%s); it goes back to the broker",
                item.prompt.prompt_id,
                item.failed,
            )
            self._give_back(item)
            return
        batch = self.assembly.build(key, item, self.closing)
        if batch is None:
            self._give_back(item)
        else:
            self.finisher.submit(batch)

    def _give_back(self, item: InFlight) -> None:
        """The prompt goes back to the broker (on the finisher's thread: nothing here waits for the broker)."""
        if item.trace is not None:
            item.trace.dropped(item.prompt.prompt_id)
        if self.finisher is None:
            return  # never started: shutdown returns every open lease
        self.finisher.give_back(item.lease.lease_id, [item.prompt.prompt_id])

    def _pushed(self, batch: Batch | None) -> None:  # the finisher's thread
        self.budget.released(len(batch.samples) if batch is not None else 1)
        self._wake.set()

    def wait_progress(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a sample to finish, looking at announcements meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            if self._wake.wait(min(left, POLL_SLICE_S)):
                self._wake.clear()
                return
            self.poll(0.0)

    def wait(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Sleep up to ``seconds`` while handling announcements, weights and finished samples; sooner once
        ``until()`` holds."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self.poll(min(left, WAIT_SLICE_S))
            if until is not None and until():
                return

    def poll(self, timeout_s: float) -> None:
        """Announcements (waiting up to ``timeout_s`` for one), the catch-up poll, new weights."""
        self._polled = time.monotonic()
        if self.finisher is not None and self.finisher.error is not None:
            raise self.finisher.error
        if self.pipeline_error is not None:
            raise self.pipeline_error
        ann = self.sub.next(timeout_s) if timeout_s > 0 else None
        for a in ([ann] if ann is not None else []) + self.sub.drain():
            self.on_announcement(a)
        if time.monotonic() >= self._next_catchup:
            cv = self.client.current_version()
            self.on_current(cv.version, cv.weights, cv.paused)
            self._next_catchup = time.monotonic() + CATCHUP_S
        self.apply_weights()

    # ------------------------------------------------------------------- announcements, weights

    def on_announcement(self, ann: m.Announcement) -> None:
        if isinstance(ann, m.VersionAnnouncement):
            self.announced += 1
            self.offer_version(ann.version, ann.weights)
        elif ann.action in ("pause", "resume"):
            self.set_paused(ann.action == "pause", ann.reason)
        elif ann.action == "stop":
            self.request_stop(f"stop announced by the broker{': ' + ann.reason if ann.reason else ''}")
        elif ann.action == "done":
            self.on_job_done(ann.reason)
        # discard: the broker drops its queued groups; nothing changes here

    def on_current(self, version: int, weights: m.WeightsInfo, paused: bool) -> None:
        """The broker's state from Registered / CurrentVersion: the catch-up path."""
        self.offer_version(version, weights)
        self.set_paused(paused, "broker state")

    def on_job_done(self, reason: str) -> None:
        """Training is over: stop, unless rollout.stay_after_done."""
        if exits_on_done(self.cfg.rollout.stay_after_done, reason, self._told_done):
            self.request_stop(f"done: {reason or 'the learner finished'}")
        self._told_done = True

    def set_paused(self, paused: bool, reason: str = "") -> None:
        if paused != self.paused:
            log.info("%s leasing (%s)", "pausing" if paused else "resuming", reason or "control announcement")
            self.paused = paused

    def offer_version(self, version: int, weights: m.WeightsInfo) -> None:
        self.weights.offer(version, weights)

    def _weights_ready(self) -> None:  # the receiver's thread: a complete version is held
        """Wake the main loop, wherever it waits, to load it now: until it is loaded the broker counts this
        server a version behind and shrinks its admission window (issue 24)."""
        self._wake.set()
        if self.sub is not None:
            self.sub.wake()

    def apply_weights(self) -> None:
        """An in-flight update when the receiver holds a complete version (rollout/apply.py)."""
        self.weights.apply(len(self.inflight))

    def _loaded(self, version: int) -> None:
        """New weights are in the engine: tell the broker at once (its throttle reads the version)."""
        try:
            self.client.heartbeat(version, self.heartbeat_stats()[1])
        except (BrokerError, BrokerUnavailable) as e:
            log.debug("heartbeat after the weight update failed: %s", e)

    # --------------------------------------------------------------------------------- stats

    def batch_stats(self) -> dict[str, float]:
        """What each metrics line adds: the weights' and the environment's counters (finisher thread)."""
        return {**self.weight_stats(), **self.env.metrics(), **(self.endpoint.metrics() if self.endpoint else {})}

    def weight_stats(self) -> dict[str, float]:
        """Weight sync and this process's resources (``resource/rollout/*``): in each metrics line and heartbeat."""
        return {**self.weights.metrics(), **self.resources.sample()}

    def heartbeat_stats(self) -> tuple[int, dict[str, float]]:
        """(policy version, stats) for the broker's status: called from the client's thread."""
        self._check_stall()
        stats = {
            **self.stats.heartbeat(),
            **self.weight_stats(),
            "rollout/policy_version": float(self.version),
            "rollout/paused": float(self.paused),
            "rollout/inflight": float(self.budget.unpushed),
        }
        return self.version, stats

    def _check_stall(self) -> None:
        """(heartbeat thread) Log once, with every thread's stack, when the main loop stopped polling."""
        stalled = time.monotonic() - self._polled
        if stalled < STALL_S:
            self._stall_logged = False
            return
        if self._stall_logged:
            return
        self._stall_logged = True
        log.error(
            "the main loop has not polled for %.0f s: this server takes no new weights and no prompts until it "
            "does (its heartbeat goes on); every thread's stack:\n%s",
            stalled,
            thread_stacks(),
        )


# ------------------------------------------------------------------------------------- helpers


def thread_stacks() -> str:
    """Every thread's current stack, innermost call last (what `py-spy dump` would show of the Python side)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def broker_address(cfg: JobConfig, cli_address: str | None, run_dir: str | Path | None) -> str:
    """See :func:`fleetrl.broker.client.address.resolve_address` (--broker > broker.address > broker.json > host:port)."""
    return resolve_address(cfg.broker, run_dir, cli_address)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def ready_path(run_dir: str | Path, server_index: int) -> Path:
    return Path(run_dir) / f"rollout-{server_index}.ready"


def write_ready(run_dir: Path, server_index: int, client_id: str, version: int) -> Path:
    """``rollout-<i>.ready``: the launcher's signal that this server loaded its engine and registered."""
    path = ready_path(run_dir, server_index)
    tmp = path.with_suffix(".ready.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "client_id": client_id, "policy_version": version}))
    tmp.replace(path)
    return path


def install_signals(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: stop after the groups in flight. Second: abandon them (raise Abort)."""

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            log.info("%s: finishing the groups in flight, then exiting (send it again to abandon them)", name)
            stop.set()
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.info("%s again: abandoning the groups in flight and returning their prompts", name)
        raise Abort()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(args) -> int:
    STARTUP.mark("python+imports")
    overrides = list(args.overrides) + ([f"rollout.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)
    require_model_dir(cfg.model.path)  # one line naming the key, before from_pretrained would try the hub
    index = args.server_index
    setup_logging(f"rollout-{index}", cfg.telemetry.log_level)
    if args.run_dir:
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        ready_path(args.run_dir, index).unlink(missing_ok=True)  # a previous run's signal must not count
    stop = threading.Event()
    install_signals(stop)
    client_id = default_client_id("rollout", index, client_identity(cfg.broker.curve, "rollout"))
    faults.at("rollout.server_index", index)
    tracing.setup_tracing(
        "rollout",
        cfg.telemetry,
        args.run_dir,
        {"service.instance.id": f"rollout-{index}", "fleetrl.client_id": client_id, "fleetrl.server_index": index},
    )
    device = resolve_device(cfg.rollout.device)
    STARTUP.mark("config")
    engine = scorer = client = receiver = env = None
    try:
        engine = create_engine(cfg.rollout.engine, cfg.model, cfg.rollout, device, cfg.rollout.seed + index)
        STARTUP.mark("engine")
        env = create_env(cfg, engine.tokenizer)
        scorer = RewardScorer.from_config(cfg.rollout)
        STARTUP.mark("rewards")
        receiver = engine.weight_receiver(cfg, device, client_id)
        address = broker_address(cfg, args.broker, args.run_dir)
        client = ZmqBrokerClient(
            address,
            client_id,
            "rollout",
            rank=index,
            timeout_s=cfg.broker.request_timeout_s,
            curve=cfg.broker.curve,
            info={"engine": cfg.rollout.engine, "device": device, "receivers": str(getattr(receiver, "receivers", 1))},
            loop=engine.loop.loop,
        )  # one event loop: the engine's, the pipeline's, the broker's
        endpoint = None
        if cfg.rollout.openai.enabled:
            from fleetrl.rollout.endpoint.server import Endpoint

            endpoint = Endpoint(cfg, engine, env, index, args.run_dir)
        server = RolloutServer(
            cfg,
            client,
            engine,
            scorer,
            server_index=index,
            run_dir=args.run_dir,
            receiver=receiver,
            stop_event=stop,
            env=env,
            endpoint=endpoint,
        )
        return server.run()
    except BrokerUnauthorized as e:
        log.error("giving up, the broker refused this server's key: %s", e)
        return EXIT_BROKER_UNAVAILABLE
    except BrokerUnavailable as e:
        hint = (
            ""
            if "request_timeout_s" in str(e)
            else (
                f" (check broker.address / --broker, or raise broker.request_timeout_s={cfg.broker.request_timeout_s:g})"
            )
        )
        log.error("giving up, the broker is unreachable: %s%s", e, hint)
        return EXIT_BROKER_UNAVAILABLE
    except RewardsHopeless as e:
        log.error("stopping: %s", e)
        return EXIT_REWARDS_HOPELESS
    except Abort:
        return 0
    finally:
        for part in (receiver, scorer, client, env, engine):
            if part is not None:
                part.close()
