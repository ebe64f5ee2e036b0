"""With dynamic sampling a learner rank leases about ``need / keep_rate`` groups at once (issue 24): a step takes
one or two leases instead of a halving series of round trips (each ~5 ms of the learner's wait on the demo), and
the kept groups beyond the step's share go back to the front of the queue untrained: nothing lost, nothing
trained twice, and the broker's consumption meter counts only what was kept or filtered."""

from __future__ import annotations

import numpy as np

from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.learner.source import BrokerBatchSource
from tests.broker.conftest import make_state
from tests.learner.conftest import inproc_client

WANT = 8


def half_flat_groups(n: int, seed: int = 0) -> list[m.SampleGroup]:
    """Groups of 4 whose rewards tie (dynamic sampling drops them) for every other group, mixed otherwise."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        responses = [(rng.integers(7, 263, 3), np.full(3, -1.0)) for _ in range(4)]
        rewards = [0.0] * 4 if g % 2 else [1.0, 0.0, 1.0, 0.0]
        out.append(m.build_group(f"g{g}", f"0:{g}", 0, rng.integers(7, 263, 5), responses, rewards))
    return out


class Counting:
    """The learner client, counting lease round trips."""

    def __init__(self, client):
        self.client, self.leases = client, 0

    def lease_batch(self, *a, **kw):
        self.leases += 1
        return self.client.lease_batch(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_step_takes_at_most_two_leases_once_the_keep_rate_is_known_and_nothing_is_lost_or_trained_twice():
    pushed = half_flat_groups(240)
    client, broker = inproc_client(pushed)
    counting = Counting(client)
    cfg = load_config(None, ["algorithm.dynamic_sampling=true", f"learner.groups_per_step={WANT}"])
    src = BrokerBatchSource(counting, cfg, 0, 1)
    trained: list[str] = []
    filtered: list[str] = []
    rounds = []
    for step in range(1, 9):
        before = counting.leases
        leased = src.next(step)
        rounds.append(counting.leases - before)
        assert len(leased.groups) == WANT and all(g.rewards[0] != g.rewards[1] for g in leased.groups)
        trained += [g.group_id for g in leased.groups]
        filtered += leased.filtered_ids
        src.ack(leased, step)
    assert rounds[0] >= 3  # the first step halves its way to its share: 8 -> 4 -> 2 -> 1 ...
    assert max(rounds[1:]) <= 2, rounds
    assert abs(src.keep_rate - 0.5) < 0.15
    assert len(set(trained)) == len(trained) and not set(trained) & set(filtered)
    state = broker.state
    # every group was trained once, filtered once, or is queued again (the surplus went back to the front)
    assert state.counters["groups_trained"] == len(trained) + len(filtered)
    assert len(state.q) == len(pushed) - len(trained) - len(filtered)
    assert not state.batches.leases  # no lease left open after the steps' acks


def test_the_consumption_meter_counts_only_what_was_kept_or_filtered():
    """Groups given back untrained (a lease closed with them unacknowledged) are not counted as consumed."""
    state = make_state(
        "broker.accept_unleased=true", "broker.admission=measured", f"learner.groups_per_step={WANT}", vocab_size=263
    )
    broker = InprocBroker(state)
    rollout = broker.client("r0", "rollout")
    rollout.connect()
    assert all(a.status == "accepted" for a in rollout.push_groups(half_flat_groups(20)))
    client = broker.client("learner-0", "learner")
    client.connect()
    meter = state.measured
    assert meter is not None
    lease = client.lease_batch(12)
    assert isinstance(lease, m.BatchLease) and len(lease.groups) == 12 and meter.taken == 12
    ids = [g.group_id for g in lease.groups]
    client.ack_batch(lease.lease_id, ids[:3], 1, keep_rest=True)  # filtered now: the lease keeps the rest
    assert meter.taken == 12
    client.ack_batch(lease.lease_id, ids[3:5], 1)  # the step's ack: 7 go back to the queue untrained
    assert meter.taken == 5 and len(state.q) == 20 - 5


def test_without_dynamic_sampling_a_lease_asks_for_the_share_only():
    client, _ = inproc_client(half_flat_groups(40))
    counting = Counting(client)
    src = BrokerBatchSource(counting, load_config(None, [f"learner.groups_per_step={WANT}"]), 0, 1)
    leased = src.next(1)
    assert len(leased.groups) == WANT and counting.leases == 1 and src._ask(WANT) == WANT
