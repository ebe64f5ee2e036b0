"""Dynamic sampling at the rollout (issue 24): prompts of groups without signal come back `filtered`, are
counted, free the admission window at once, and are issued again at most `broker.reissue_filtered` times.

The property test drives the broker's state machine with simulated rollouts (random speeds, filter rates,
kills) and a simulated learner, and holds it to the staleness invariant and to admission capacity."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from fleetrl.broker.metrics import status_metrics
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.broker.test_state import lease_batch, lease_prompts, push
from tests.helpers import make_group


def give_back_filtered(state, lease, ids, client="r0", now=0.0):
    return state.handle(m.ReturnPrompts(req_id=7, client_id=client, lease_id=lease.lease_id, prompt_ids=ids,
                                        filtered=True), now)


def test_filtered_prompts_are_counted_free_capacity_and_are_not_reissued():
    state = make_state()  # capacity 4 x 1 x (2 + 1) = 12
    assert state.capacity == 12
    lease = lease_prompts(state, 12)
    assert len(lease.prompts) == 12 and isinstance(lease_prompts(state, 1, client="r1"), m.Throttle)
    ids = [p.prompt_id for p in lease.prompts[:5]]
    assert give_back_filtered(state, lease, ids).count == 5
    assert state.counters["prompts_filtered"] == 5 and not state.prompts.reissue and state.load() == 7
    nxt = lease_prompts(state, 10, client="r1")  # the window they held is open again, and the cursor moved on
    assert [p.prompt_id for p in nxt.prompts] == [f"0:{i}" for i in range(12, 17)]
    assert status_metrics(state.status(0, 0.0))["broker/prompts_filtered"] == 5.0


def test_a_prompt_that_is_always_filtered_is_reissued_at_most_the_configured_times():
    state = make_state("broker.reissue_filtered=1")
    first = lease_prompts(state, 1)
    assert give_back_filtered(state, first, ["0:0"]).count == 1 and len(state.prompts.reissue) == 1
    again = lease_prompts(state, 1)
    assert [p.prompt_id for p in again.prompts] == ["0:0"]  # re-issued once
    assert give_back_filtered(state, again, ["0:0"]).count == 1
    assert not state.prompts.reissue and state.prompts.leased == 0  # and then not again: no spin
    assert [p.prompt_id for p in lease_prompts(state, 1).prompts] == ["0:1"]
    assert state.counters["prompts_filtered"] == 2 and state.counters["prompts_filtered_reissued"] == 1


def test_filtered_returns_for_prompts_already_closed_change_nothing():
    state = make_state()
    lease = lease_prompts(state, 2)
    assert push(state, make_group("0:0")).count == 1
    assert give_back_filtered(state, lease, ["0:0"]).count == 0  # its group arrived: not counted twice
    assert state.counters["prompts_filtered"] == 0 and state.prompts.leased == 1


def simulate(seed: int, filter_rate: float, max_staleness: int, rollouts: int, kill_rate: float,
             ticks: int = 80, at_learner: bool = False) -> dict:
    """A seeded run: each tick, every live rollout may finish its lease (speed), filter some groups, or die;
    the learner trains `groups_per_step` groups a step and publishes every step. Checks every invariant as it goes."""
    rng = random.Random(seed)
    state = make_state(f"broker.max_staleness={max_staleness}", "broker.client_timeout_s=3", "broker.prompt_lease_s=60",
                       n_prompts=400, epochs=50)
    speed = [rng.uniform(0.1, 1.0) for _ in range(rollouts)]
    live = [True] * rollouts
    held = [0] * rollouts  # the weights each rollout holds
    leases: list[list] = [[] for _ in range(rollouts)]
    trained, pushed, filtered, stale_on_arrival, useful = [], set(), 0, 0, 0
    step, now = 0, 0.0
    for _tick in range(ticks):
        now += 1.0
        state.expire(now)
        for r in range(rollouts):
            cid = f"r{r}"
            if not live[r]:
                continue
            if rng.random() < kill_rate:  # dies mid-pipeline: its leases come back after client_timeout_s
                live[r] = False
                continue
            if rng.random() < 0.5:
                held[r] = state.version  # loads the announced weights
            reply = lease_prompts(state, rng.randint(1, 6), client=cid, version=held[r], now=now)
            if isinstance(reply, m.PromptLease):  # admission never grants beyond the window
                assert state.load() <= state.capacity
                leases[r].append((reply, held[r]))
            if leases[r] and rng.random() < speed[r]:
                lease, version = leases[r].pop(0)
                flat = [p.prompt_id for p in lease.prompts if rng.random() < filter_rate]
                if at_learner:  # today's path: flat groups are pushed, and the learner discards them
                    for p in lease.prompts:
                        g = make_group(p.prompt_id, version=version, rewards=[1.0, 1.0] if p.prompt_id in flat else None)
                        state.handle(m.PushGroup(req_id=2, client_id=cid, group=g), now)
                    continue
                if flat:
                    filtered += give_back_filtered(state, lease, flat, client=cid, now=now).count
                for p in lease.prompts:
                    if p.prompt_id not in flat:
                        g = make_group(p.prompt_id, version=version)
                        ack = state.handle(m.PushGroup(req_id=2, client_id=cid, group=g), now)
                        if isinstance(ack, m.Ack) and ack.count:
                            pushed.add(g.group_id)
                        elif isinstance(ack, m.Ack) and not ack.duplicate:
                            stale_on_arrival += 1  # acknowledged as stale, counted in dropped_stale
        batch = lease_batch(state, 4, now=now)
        if isinstance(batch, m.BatchLease):
            for g in batch.groups:  # the invariant: no trained group is older than max_staleness versions
                assert state.version - g.policy_version <= max_staleness
            trained.extend(g.group_id for g in batch.groups)
            useful += sum(len(set(g.rewards)) > 1 for g in batch.groups)
            step += 1
            state.handle(m.AckBatch(req_id=4, client_id="l0", lease_id=batch.lease_id, step=step,
                                    group_ids=[g.group_id for g in batch.groups]), now)
            state.handle(m.PublishVersion(req_id=5, client_id="l0", version=state.version + 1, step=step), now)
    if at_learner:
        return {"useful": useful}
    assert set(trained) <= pushed and len(trained) == len(set(trained))
    # no acknowledged group is lost: each was trained, dropped as stale and counted, or is still held
    assert len(pushed) == len(trained) + state.counters["dropped_stale"] - stale_on_arrival + len(state.groups)
    assert filtered == state.counters["prompts_filtered"]
    return {"trained": len(trained), "filtered": filtered, "useful": useful}


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), filter_rate=st.floats(0.0, 1.0), max_staleness=st.integers(0, 3),
       rollouts=st.integers(1, 4), kill_rate=st.sampled_from([0.0, 0.002, 0.02]))
def test_staleness_invariant_under_random_filter_rates_speeds_and_kills(seed, filter_rate, max_staleness, rollouts,
                                                                         kill_rate):
    simulate(seed, filter_rate, max_staleness, rollouts, kill_rate)


def test_filtered_prompts_do_not_eat_the_window_the_learner_trains_from():
    """Half the groups without signal: filtered at the rollout, their prompts give their admission slots back at
    once, so the learner trains more useful groups than when they are pushed and discarded at the learner."""
    here = simulate(seed=3, filter_rate=0.5, max_staleness=2, rollouts=3, kill_rate=0.0, ticks=80)
    there = simulate(seed=3, filter_rate=0.5, max_staleness=2, rollouts=3, kill_rate=0.0, ticks=80, at_learner=True)
    assert here["filtered"] > 30 and here["useful"] > there["useful"], (here, there)
