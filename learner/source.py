"""Where a learner rank's batches come from: batch leases from the broker (or its in-process twin).

Each rank leases its share of ``learner.groups_per_step``. The fleet screen (learner/screen.py) first
leaves out every group no honest rollout server could have sent, and every group of a quarantined
server; a lease left with nothing is leased again. With DAPO's dynamic sampling, groups whose
rewards are all equal carry no gradient: they are filtered out and the rank keeps leasing — at most
``learner.max_lease_rounds`` leases per step — until its share is full. Every leased group (kept,
screened or filtered) is acknowledged, so the broker neither redelivers nor loses it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from fleetrl.broker.client.roles import LearnerClient
from fleetrl.common import faults
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import dynamic_sampling_filter
from fleetrl.learner.screen import FleetScreen

log = logging.getLogger(__name__)
OVERLEASE = 4  # a dynamic-sampling lease asks for at most this many times the groups the step still needs
KEEP_ALPHA = 0.2  # weight of the newest lease in the running keep rate
LEASE_SLICE_S = 2.0  # longest broker long-poll of one lease request: a stop is looked at between them
CANCEL_SLICE_S = 0.2  # the same for a lease ahead (Prefetch): a rollback or the end cancels it at once


class FleetIdle(RuntimeError):
    """No groups arrived within learner.batch_wait_s."""


class Interrupted(Exception):
    """A stop was requested while waiting for groups (nothing was leased for this step)."""


@dataclass
class Leased:
    """What a source hands the learner for one step: leased groups, or (offline DPO) preference pairs."""

    groups: list[m.SampleGroup]  # kept for training
    leases: list[tuple[str, list[str]]] = field(default_factory=list)  # (lease id, group ids to ack after the step)
    filtered: int = 0  # groups dropped by dynamic sampling
    filtered_ids: list[str] = field(default_factory=list)  # their ids (acked, not trained: trained-<rank>.jsonl)
    dropped_stale: int = 0
    screened_ids: list[str] = field(default_factory=list)  # left out by the fleet screen (acked, not trained)
    servers: dict[str, dict[str, float]] = field(default_factory=dict)  # server -> {"groups", "screened"}
    screen_reasons: list[str] = field(default_factory=list)  # why, for the first few screened groups
    wait_s: float = 0.0  # how long the step waited for this batch
    lease_s: float = 0.0  # how long leasing it took (longer than wait_s when it was leased during the step before)
    pairs: list[tuple[list[int], list[int], list[int]]] | None = None  # offline DPO: (prompt, chosen, rejected) ids
    pair_ids: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        """The ids of what this step trains on (group ids, or pair ids offline), for the trained log."""
        return list(self.pair_ids) if self.pairs is not None else [g.group_id for g in self.groups]


def share_of(total: int, rank: int, world: int) -> int:
    """This rank's part of ``total`` groups (the first ``total % world`` ranks take one more)."""
    return total // world + (1 if rank < total % world else 0)


class RefusalWatch:
    """While a rank waits for groups, whether the broker is refusing what the fleet sends.

    A fleet whose every group is refused at ingest (e.g. a policy collapsed to exact-0.0 log-probs at
    temperature > 0: ``broker.max_zero_logprob_fraction``) looks like an idle fleet from here. After
    ``first_s`` of waiting this takes the broker's ``implausible/*`` counters as a baseline, warns every
    ``every_s`` when they rose (and hands ``on_refused`` the count and the warning: the trainer records it as a
    ``fleet_refused`` health event), and names them in the idle error.
    """

    def __init__(
        self,
        client: LearnerClient,
        first_s: float = 5.0,
        every_s: float = 30.0,
        on_refused: Callable[[int, str], None] | None = None,
    ):
        self.client, self.first_s, self.every_s, self.on_refused = client, first_s, every_s, on_refused
        self.t0 = time.monotonic()
        self.base: dict[str, int] | None = None
        self.warned_at = self.t0

    def _counters(self) -> dict[str, int]:
        try:
            counters = self.client.status().counters
        except Exception:  # noqa: BLE001 - a status call that fails only loses the diagnosis
            return {}
        return {k: v for k, v in counters.items() if k.startswith("implausible/")}

    def rose(self) -> dict[str, int]:
        if self.base is None:
            return {}
        now = self._counters()
        return {k: v - self.base.get(k, 0) for k, v in now.items() if v > self.base.get(k, 0)}

    def check(self) -> None:
        t = time.monotonic()
        if self.base is None:
            if t - self.t0 >= self.first_s:
                self.base, self.warned_at = self._counters(), t
            return
        if t - self.warned_at >= self.every_s:
            self.warned_at = t
            rose = self.rose()
            if text := self.summary(rose):
                log.warning("no groups for %.0f s%s", t - self.t0, text)
                if self.on_refused is not None:
                    self.on_refused(sum(rose.values()), f"no groups for {t - self.t0:.0f} s{text}")

    def summary(self, rose: dict[str, int] | None = None) -> str:
        """The refusals since the baseline, as a clause for a message ('' when none); ``rose`` if already read."""
        rose = self.rose() if rose is None else rose
        if not rose:
            return ""
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(rose.items()))
        return (
            f", while the broker refused {sum(rose.values())} groups at ingest ({kinds}): the rollouts run but "
            "what they send is refused (the broker's log names each group and why; a policy collapsed to "
            "log-probs of exactly 0.0 at temperature > 0 trips broker.max_zero_logprob_fraction)"
        )


class BrokerBatchSource:
    def __init__(self, client: LearnerClient, cfg: JobConfig, rank: int, world: int):
        self.client, self.cfg = client, cfg
        self.want = max(1, share_of(cfg.learner.groups_per_step, rank, world))
        self.dynamic = cfg.algorithm.dynamic_sampling
        self.filtered_total = 0
        self.screen = FleetScreen(cfg.health.screen) if cfg.health.enabled and cfg.health.screen.enabled else None
        self.quarantined: set[str] = set()  # servers whose groups are left out (HealthMonitor.quarantined)
        # dynamic sampling keeps about this fraction of a lease (a running average): a lease asks for what the
        # step still needs divided by it, so a step takes one or two leases, not a halving series of them
        self.keep_rate = 1.0
        self.on_refused: Callable[[int, str], None] | None = None  # (groups refused, why): set by the trainer

    def _ask(self, need: int) -> int:
        """How many groups to lease for ``need`` more kept ones: ``need / keep_rate``, at most OVERLEASE x need."""
        if not self.dynamic:
            return need
        return min(math.ceil(need / max(self.keep_rate, 1.0 / OVERLEASE)), OVERLEASE * need)

    def _lease(
        self,
        n: int,
        deadline: float,
        should_stop: Callable[[], bool],
        least: int | None = None,
        for_version: int = 0,
        slice_s: float = LEASE_SLICE_S,
    ) -> m.BatchLease:
        wait = self.cfg.learner.batch_wait_s
        refusals = RefusalWatch(
            self.client, first_s=min(5.0, 0.2 * wait), every_s=min(30.0, 0.5 * wait), on_refused=self.on_refused
        )
        while True:
            if should_stop():
                raise Interrupted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise FleetIdle(
                    f"no groups arrived within learner.batch_wait_s={self.cfg.learner.batch_wait_s:g} s"
                    f"{refusals.summary()}; check that rollout servers run (`fleetrl status --broker ADDR`) "
                    "or raise that setting"
                )
            ahead = {"for_version": for_version} if for_version else {}
            asked = time.monotonic()
            reply = self.client.lease_batch(n, wait_s=min(slice_s, left), min_groups=least or n, **ahead)
            if isinstance(reply, m.BatchLease):
                return reply
            refusals.check()
            # the retry delay counts from the request: a long poll that held it that long asks again at once
            pause = reply.retry_after_s - (time.monotonic() - asked)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))

    def next(
        self,
        step: int,
        should_stop: Callable[[], bool] = lambda: False,
        for_version: int = 0,
        slice_s: float = LEASE_SLICE_S,
    ) -> Leased:
        """This rank's groups for training step ``step`` (1-based); ``for_version``: the policy version the step
        will train at when that is newer than the broker's (a lease ahead of the publish: ``Prefetch``);
        ``should_stop`` is looked at every ``slice_s`` while the broker has too few groups."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.learner.batch_wait_s
        out = Leased(groups=[])
        rounds, last = 0, []
        while rounds < (self.cfg.learner.max_lease_rounds if self.dynamic else 1):
            need = self.want - len(out.groups)
            lease = self._lease(self._ask(need), deadline, should_stop, need, for_version, slice_s)
            out.dropped_stale += lease.dropped_stale
            plausible = self._screen(lease.groups, out)
            kept = self._filter(plausible) if self.dynamic and plausible else plausible
            if self.dynamic and plausible:
                self.keep_rate += KEEP_ALPHA * (len(kept) / len(plausible) - self.keep_rate)
            # kept beyond the step's share stay in the lease, not acknowledged: the step's ack requeues them
            # at the front of the queue (the broker checks their staleness again when they are leased)
            surplus = {g.group_id for g in kept[need:]}
            kept = kept[:need]
            kept_ids = {g.group_id for g in kept}
            done_now = [g.group_id for g in lease.groups if g.group_id not in kept_ids and g.group_id not in surplus]
            if done_now:
                # done with them now: they would otherwise hold admission capacity while the rank keeps leasing
                self.client.ack_batch(lease.lease_id, done_now, step, keep_rest=bool(kept))
            if kept:
                out.leases.append((lease.lease_id, [g.group_id for g in kept]))
            filtered = [g.group_id for g in plausible if g.group_id not in kept_ids]
            out.filtered += len(filtered)
            out.filtered_ids.extend(filtered)
            out.groups.extend(kept)
            if plausible:  # a lease the screen emptied does not count as a round: lease again
                rounds, last = rounds + 1, plausible
            if len(out.groups) >= self.want:
                break
        if not out.groups:  # every group was filtered: train on what came rather than not at all
            log.warning(
                "dynamic sampling filtered every group of %d leases; training on the last lease", len(out.leases)
            )
            out.groups = list(last)
        self.filtered_total += out.filtered
        out.wait_s = out.lease_s = time.monotonic() - t0
        return out

    def _screen(self, groups: list[m.SampleGroup], out: Leased) -> list[m.SampleGroup]:
        """The groups that pass the fleet screen; the others are recorded in ``out`` (per server, with reasons)."""
        if self.screen is None:
            return groups
        verdict = self.screen.judge(groups, self.quarantined)
        for server, seen in verdict.per_server().items():
            mine = out.servers.setdefault(server, {"groups": 0.0, "screened": 0.0})
            mine["groups"] += seen["groups"]
            mine["screened"] += seen["screened"]
        out.screened_ids.extend(g.group_id for g in verdict.dropped)
        for reasons in verdict.reasons.values():
            out.screen_reasons.extend(reasons[: max(0, 5 - len(out.screen_reasons))])
        fresh = [rs[0] for server, rs in verdict.reasons.items() if server not in self.quarantined]
        if fresh:
            log.warning(
                "fleet screen left %d of %d leased groups out of the step: %s",
                len(verdict.dropped),
                len(groups),
                "; ".join(fresh),
            )
        return verdict.kept

    def quarantine(self, server: str) -> None:
        """Leave every later group of ``server`` out (a per-server rule quarantined it)."""
        self.quarantined.add(server)

    @staticmethod
    def _filter(groups: list[m.SampleGroup]) -> list[m.SampleGroup]:
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rewards])
        keep, _ = dynamic_sampling_filter(rewards, index)
        kept_groups = {int(i) for i in index[keep]}
        return [g for i, g in enumerate(groups) if i in kept_groups]

    def ack(self, leased: Leased, step: int) -> None:
        faults.at("learner.step")  # a chaos run pins here: trained, not acknowledged yet
        for lease_id, group_ids in leased.leases:
            self.client.ack_batch(lease_id, group_ids, step)

    def give_back(self, leased: Leased, step: int) -> None:
        """Untrained: every group still held by ``leased``'s leases goes back to the front of the broker's queue
        (the broker checks its staleness again when it is leased next)."""
        for lease_id, _ in leased.leases:
            self.client.ack_batch(lease_id, [], step, give_back=True)

    def state_dict(self) -> dict[str, int]:
        """Nothing to save: the broker keeps the data cursor (see broker.commit_on_checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class Prefetch:
    """The next step's batch, leased on a thread while this step trains (``learner.prefetch``).

    ``start`` leases for step ``step`` at ``for_version``, the policy version that step will train at (one newer
    than the broker's when this step publishes), so the broker's staleness bound already holds for it. ``take``
    hands it over if it was leased for that step and nothing it was judged against changed: the learner's version
    is not newer than ``for_version`` (a rollback or resume publishes one) and no server was quarantined since.
    Otherwise it goes back to the queue and the step leases as without a prefetch. Errors of the lease (the fleet
    idle, a stop) are raised by ``take``.

    A broker that restarts forgets its open leases and queues their groups again, the batch being trained
    included, whose acknowledgement then arrives late (it takes back only groups still queued). So a lease ahead
    that returns a group the step is training gives its lease back and leases again once the step has
    acknowledged (``step_acked``): the late acknowledgement finds those groups queued and consumes them, and
    none is trained twice.
    """

    def __init__(self, source: BrokerBatchSource):
        self.source = source
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fleetrl-prefetch")
        self.pending: tuple[Future[Leased], int, int, frozenset[str]] | None = None
        self.cancelled = False
        self.given_back = 0  # prefetched batches that could not be used
        self.released = 0  # leases ahead given back for holding a group being trained
        self.training: frozenset[str] = frozenset()
        self.acked = threading.Event()

    def start(
        self, step: int, for_version: int, should_stop: Callable[[], bool], training: Sequence[m.SampleGroup] = ()
    ) -> None:
        """Lease step ``step``'s batch on the thread, while the groups ``training`` are trained."""
        stop = lambda: self.cancelled or should_stop()  # noqa: E731
        self.training = frozenset(g.group_id for g in training)
        self.acked.clear()
        future = self.pool.submit(self._lease, step, stop, for_version)
        self.pending = (future, step, for_version, frozenset(self.source.quarantined))

    def step_acked(self) -> None:
        """The step being trained was acknowledged."""
        self.acked.set()

    def _lease(self, step: int, stop: Callable[[], bool], for_version: int) -> Leased:
        leased = self.source.next(step, stop, for_version, CANCEL_SLICE_S)
        again = {g.group_id for g in leased.groups} & self.training
        if not again:
            return leased
        log.warning(
            "the broker leased again %d group(s) this step is training (it restarted and forgot their lease): "
            "the lease goes back, and the next batch is leased once this step is acknowledged",
            len(again),
        )
        self.source.give_back(leased, step)
        self.released += 1
        while not self.acked.wait(0.05):
            if stop():
                raise Interrupted()
        fresh = self.source.next(step, stop, for_version, CANCEL_SLICE_S)
        fresh.filtered += leased.filtered  # consumed by the first lease: still this step's record
        fresh.filtered_ids[:0] = leased.filtered_ids
        fresh.screened_ids[:0] = leased.screened_ids
        fresh.dropped_stale += leased.dropped_stale
        return fresh

    def take(self, step: int, version: int, should_stop: Callable[[], bool]) -> Leased:
        """The batch for ``step`` while the learner holds policy ``version``."""
        if self.pending is None:
            return self.source.next(step, should_stop)
        future, leased_for, for_version, quarantined = self.pending
        self.pending = None
        t0 = time.monotonic()
        leased = future.result()
        waited = time.monotonic() - t0
        if leased_for == step and version <= for_version and self.source.quarantined <= quarantined:
            leased.wait_s = waited
            return leased
        log.info(
            "the batch leased ahead for step %d goes back to the queue (leased for step %d at version %d; the "
            "learner holds version %d%s)",
            step,
            leased_for,
            for_version,
            version,
            "; a server was quarantined since" if not self.source.quarantined <= quarantined else "",
        )
        self.source.give_back(leased, step)
        self.given_back += 1
        fresh = self.source.next(step, should_stop)
        fresh.wait_s += waited
        return fresh

    def cancel(self, step: int) -> None:
        """Stop a lease in flight and give back what it holds (before a rollback, or at the end of training)."""
        if self.pending is None:
            return
        future = self.pending[0]
        self.pending, self.cancelled = None, True
        try:
            leased = future.result()
        except (Interrupted, FleetIdle):
            return
        finally:
            self.cancelled = False
        self.source.give_back(leased, step)

    def close(self, step: int) -> None:
        try:
            self.cancel(step)
        except Exception as e:  # noqa: BLE001 - the broker may be gone at the end: its lease expiry takes them back
            log.debug("giving back the prefetched batch at close failed: %s", e)
        self.pool.shutdown(wait=True)
