"""Admission sized from measured consumption (issue 24): with dynamic sampling a learner takes more groups per
version than it trains, and the broker's window follows what it takes, within the off-policy bound.

The property test drives the broker's state machine with simulated rollouts (random speeds and kills) and a
learner that filters a random share of what it leases (acknowledging those at once, as `BrokerBatchSource`
does) and keeps leasing until its step is full. It holds the run to the staleness invariant, to admission
capacity and to "no acknowledged group is lost"."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.broker.client.metrics import status_metrics
from fleetrl.broker.server.admission import Admission
from fleetrl.broker.server.staleness import MeasuredCapacity, admission_capacity
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.broker.server.test_state import ack, lease_batch, lease_prompts, publish
from tests.helpers import make_group


def test_without_filtering_the_measured_window_is_the_static_one():
    meter = MeasuredCapacity(per_version=16, max_staleness=2)
    assert meter.capacity == admission_capacity(16, 1, 2) == 48
    for v in range(1, 20):
        meter.taken_by_learner(16)
        meter.published(v)
    assert meter.capacity == 48


def test_half_filtered_doubles_the_window_and_it_follows_the_rate_back_down():
    meter = MeasuredCapacity(per_version=16, max_staleness=2)
    meter.published(0)
    for v in range(1, 30):
        meter.taken_by_learner(32)  # the learner leases twice its share: half had no reward spread
        meter.published(v)
    assert 95 <= meter.capacity <= 96
    for v in range(30, 90):
        meter.taken_by_learner(16)
        meter.published(v)
    assert meter.capacity == 48  # never below the static window


def test_the_window_is_bounded_when_nearly_everything_is_filtered():
    meter = MeasuredCapacity(per_version=4, max_staleness=1, max_factor=8.0)
    meter.published(0)
    for v in range(1, 50):
        meter.taken_by_learner(4000)
        meter.published(v)
    assert meter.capacity == 4 * 8 * 2


def test_a_rewind_or_a_jump_counts_per_version_and_restarts_the_count():
    meter = MeasuredCapacity(per_version=10, max_staleness=0, alpha=1.0)
    meter.taken_by_learner(99)
    meter.published(5)  # the first version seen: nothing to divide by yet
    assert meter.capacity == 10
    meter.taken_by_learner(60)
    meter.published(7)  # two versions advanced: 30 a version
    assert meter.capacity == 30
    meter.taken_by_learner(500)
    meter.published(3)  # a rollback: the groups taken across it say nothing about a version's consumption
    assert meter.capacity == 30
    meter.taken_by_learner(20)
    meter.published(4)
    assert meter.capacity == 20


def test_the_broker_grants_more_prompts_once_learners_take_more_per_version():
    state = make_state(n_prompts=200)  # 4 groups a step, interval 1, max_staleness 2: static window 12
    assert state.capacity == 12
    for v in range(1, 8):
        for g in [
            make_group(p.prompt_id, version=state.version)
            for p in lease_prompts(state, 8, version=state.version).prompts
        ]:
            state.handle(m.PushGroup(req_id=2, client_id="r0", group=g), 0.0)
        batch = lease_batch(state, 8)
        state.handle(
            m.AckBatch(
                req_id=4, client_id="l0", lease_id=batch.lease_id, step=v, group_ids=[g.group_id for g in batch.groups]
            ),
            0.0,
        )
        publish(state, v)
    assert state.capacity > 20  # 8 taken per version (twice the share), smoothed: towards 24
    assert status_metrics(state.status(0, 0.0))["broker/capacity"] == state.capacity


def test_an_explicit_queue_capacity_or_static_admission_is_not_measured():
    for override in ("broker.queue_capacity=7", "broker.admission=static"):
        state = make_state(override)
        for v in range(1, 5):
            state.measured and state.measured.taken_by_learner(100)
            publish(state, v)
        assert state.measured is None and state.capacity == (7 if "queue" in override else 12)


def simulate(
    seed: int,
    filter_rate: float,
    max_staleness: int,
    rollouts: int,
    kill_rate: float,
    admission: str = "measured",
    ticks: int = 120,
    load_p: float = 0.7,
    prefetch: bool = False,
) -> dict:
    """A seeded run. Each tick every live rollout may die, load the announced weights, lease prompts and
    finish its oldest lease (by its speed); the learner leases, filters `filter_rate` of what comes (acking
    those at once), trains once it holds its 4 groups and publishes. Checks every invariant as it goes.
    ``prefetch`` (learner.prefetch): the learner leases ahead of its publish (``for_version`` = the next
    version), so the version moves on between the lease and the training; the bound is checked at training."""
    rng = random.Random(seed)
    prefetch = prefetch and max_staleness > 0  # as the learner: nothing to lease ahead of a synchronous publish
    state = make_state(
        f"broker.max_staleness={max_staleness}",
        "broker.client_timeout_s=3",
        "broker.prompt_lease_s=60",
        f"broker.admission={admission}",
        n_prompts=400,
        epochs=50,
    )
    speed = [rng.uniform(0.2, 1.0) for _ in range(rollouts)]
    live, held = [True] * rollouts, [0] * rollouts
    leases: list[list] = [[] for _ in range(rollouts)]
    pushed, trained, filtered, stale_on_arrival = set(), [], [], 0
    kept: list = []
    held_groups: set = set()  # (group id, its policy version) of every group leased
    step, waits, now = 0, 0, 0.0
    for _tick in range(ticks):
        now += 1.0
        state.expire(now)
        for r in range(rollouts):
            if not live[r]:
                continue
            if rng.random() < kill_rate:  # dies mid-pipeline: its leases come back after client_timeout_s
                live[r] = False
                continue
            if rng.random() < load_p:
                held[r] = state.version
            reply = lease_prompts(state, rng.randint(2, 8), client=f"r{r}", version=held[r], now=now)
            if isinstance(reply, m.PromptLease):  # admission never grants beyond the window, less the lag's share
                assert state.load() <= state.capacity
                lag, ahead = state.version - held[r], state.leases_ahead
                least = 1 + ahead if lag == 0 else 1
                assert state.measured is None or state.load() <= state.measured.capacity_at(lag + ahead, least)
                leases[r].append((reply, held[r]))
            if leases[r] and rng.random() < speed[r]:
                lease, version = leases[r].pop(0)
                for p in lease.prompts:
                    g = make_group(p.prompt_id, version=version)
                    ack = state.handle(m.PushGroup(req_id=2, client_id=f"r{r}", group=g), now)
                    if isinstance(ack, m.Ack) and ack.count:
                        pushed.add(g.group_id)
                    elif isinstance(ack, m.Ack) and not ack.duplicate:
                        stale_on_arrival += 1  # acknowledged as stale, counted in dropped_stale
        for _round in range(4):  # like learner.max_lease_rounds: lease again while the step is not full
            ahead = state.version + 1 if prefetch else 0
            batch = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=4 - len(kept), for_version=ahead), now)
            if not isinstance(batch, m.BatchLease):
                break
            for g in batch.groups:  # the invariant: no trained group is older than max_staleness versions
                assert max(ahead, state.version) - g.policy_version <= max_staleness
            held_groups.update((g.group_id, g.policy_version) for g in batch.groups)
            flat = [g.group_id for g in batch.groups if rng.random() < filter_rate]
            if flat:
                state.handle(
                    m.AckBatch(
                        req_id=4, client_id="l0", lease_id=batch.lease_id, step=step + 1, group_ids=flat, keep_rest=True
                    ),
                    now,
                )
                filtered.extend(flat)
            kept.extend((batch.lease_id, g.group_id) for g in batch.groups if g.group_id not in flat)
            if len(kept) >= 4:
                break
        if len(kept) < 4:
            waits += 1
            continue
        step += 1
        if prefetch:  # leased while the step before trained: that step's version is published first
            publish(state, state.version + 1, now=now)
        for _, gid in kept:  # the invariant where it counts: at the version the group is trained at
            assert state.version - dict(held_groups)[gid] <= max_staleness
        for lease_id in {lid for lid, _ in kept}:
            state.handle(
                m.AckBatch(
                    req_id=4,
                    client_id="l0",
                    lease_id=lease_id,
                    step=step,
                    group_ids=[gid for lid, gid in kept if lid == lease_id],
                ),
                now,
            )
        trained.extend(gid for _, gid in kept)
        kept = []
        if not prefetch:
            publish(state, state.version + 1, now=now)
    consumed = trained + filtered
    assert set(consumed) <= pushed and len(consumed) == len(set(consumed))
    held_now = len(state.groups) - len(kept)
    # no acknowledged group is lost: each was trained, filtered, dropped as stale and counted, or is still held
    assert len(pushed) == len(consumed) + state.counters["dropped_stale"] - stale_on_arrival + held_now + len(kept)
    stale = state.counters["dropped_stale"]
    return {"steps": step, "waits": waits, "capacity": state.capacity, "stale": stale}


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31),
    filter_rate=st.floats(0.0, 0.95),
    max_staleness=st.integers(0, 3),
    rollouts=st.integers(1, 4),
    kill_rate=st.sampled_from([0.0, 0.005, 0.03]),
    load_p=st.sampled_from([0.2, 0.7, 1.0]),
    prefetch=st.booleans(),
)
def test_staleness_invariant_under_random_filter_rates_speeds_and_kills(
    seed, filter_rate, max_staleness, rollouts, kill_rate, load_p, prefetch
):
    simulate(seed, filter_rate, max_staleness, rollouts, kill_rate, load_p=load_p, prefetch=prefetch)


def test_a_measured_window_keeps_a_filtering_learner_fed():
    """Half the groups filtered at the learner: the static window holds about one and a half versions of
    useful work, the measured one three; the same seeded run trains more steps and waits less."""
    measured = simulate(seed=5, filter_rate=0.5, max_staleness=2, rollouts=3, kill_rate=0.0)
    static = simulate(seed=5, filter_rate=0.5, max_staleness=2, rollouts=3, kill_rate=0.0, admission="static")
    assert measured["capacity"] > static["capacity"] == 12
    assert measured["steps"] > 1.2 * static["steps"] and measured["waits"] < static["waits"], (measured, static)


def test_a_lagging_rollout_gets_the_window_less_the_versions_it_lags():
    """Measured per version 8 (twice the share), max_staleness 2: a rollout on the newest weights may fill 3
    versions' worth; one whose weights are a version behind only 2 (the third would be dropped as stale), one
    at the bound only 1; the throttle tells the lagging one that fresher weights would get more."""
    state = make_state(n_prompts=200)
    state.measured.per_version = 8.0
    publish(state, 5)
    assert state.capacity == 24
    lease = lease_prompts(state, 100, client="r1", version=4)
    assert len(lease.prompts) == 16
    throttle = lease_prompts(state, 4, client="r1", version=4)
    assert isinstance(throttle, m.Throttle) and "load new weights" in throttle.reason
    assert isinstance(lease_prompts(state, 100, client="r2", version=3), m.Throttle)  # 16 held > 1 version's 8
    assert len(lease_prompts(state, 100, client="r0", version=5).prompts) == 8  # the newest weights: up to 24


def test_admission_for_trainable_work_drops_less_as_stale_and_trains_more(monkeypatch):
    """Rollouts that load announced weights late (30% a tick): sized without the lag, the window's tail is
    generated and then dropped as stale while it holds room that fresher weights could have used; sized with
    it, that work is not admitted, the room goes to rollouts on newer weights, and the learner trains more
    steps with fewer groups dropped per step."""
    kw = dict(seed=3, filter_rate=0.5, max_staleness=2, rollouts=3, kill_rate=0.0, load_p=0.3, ticks=200)
    aware = simulate(**kw)
    # the window before, and its check
    monkeypatch.setattr(Admission, "room", lambda self, lag=0, ahead=0: self.capacity - self.load())
    capacity_at = MeasuredCapacity.capacity_at
    monkeypatch.setattr(MeasuredCapacity, "capacity_at", lambda self, lag, least=1: capacity_at(self, 0))
    blind = simulate(**kw)
    assert aware["steps"] > 1.5 * blind["steps"], (aware, blind)
    assert aware["stale"] / aware["steps"] < 0.6 * blind["stale"] / blind["steps"], (aware, blind)


def test_the_version_being_trained_counts_as_its_whole_share_until_the_next_is_published():
    """Half filtered (8 taken per version for 4 trained). The learner took 8 at this version: 4 filtered and
    acknowledged at once, 4 trained and acknowledged. Until it publishes the next version those 8 are this
    version's share, so the window grants 24 - 8 (groups queued now are trained from the next version on),
    not 24 (the 8 more would reach the learner a version past the bound). Once published, the count restarts."""
    state = make_state(n_prompts=200)
    state.measured.per_version = 8.0
    assert state.capacity == 24
    for p in lease_prompts(state, 8).prompts:
        state.handle(m.PushGroup(req_id=2, client_id="r0", group=make_group(p.prompt_id, version=0)), 0.0)
    batch = lease_batch(state, 8)
    ids = [g.group_id for g in batch.groups]
    state.handle(m.AckBatch(req_id=4, client_id="l0", lease_id=batch.lease_id, group_ids=ids[:4], keep_rest=True), 0)
    assert state.load() == 4  # the kept 4 in flight
    assert len(lease_prompts(state, 100).prompts) == 16  # 24 - the 8 taken at this version
    ack(state, batch, ids=ids[4:])
    assert state.load() == 16 and isinstance(lease_prompts(state, 1), m.Throttle)  # trained, not yet published
    publish(state, 1)
    assert len(lease_prompts(state, 100, version=1).prompts) == 8  # a new version: 24 - the 16 leased
