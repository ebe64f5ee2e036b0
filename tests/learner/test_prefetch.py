"""learner.prefetch: the next step's batch is leased on a thread while this step trains. It is handed over only
when nothing it was judged against changed; otherwise it goes back to the front of the broker's queue untrained
and the step leases again: nothing lost, nothing trained twice, the staleness bound kept."""

from __future__ import annotations

import threading
import time

import pytest

from fleetrl.common.config import load_config
from fleetrl.learner.source import BrokerBatchSource, FleetIdle, Interrupted, Prefetch
from tests.learner.conftest import inproc_client, synthetic_groups

WANT = 4


class Counting:
    """The learner client, counting lease round trips and the threads they ran on."""

    def __init__(self, client):
        self.client, self.leases, self.threads = client, 0, set()

    def lease_batch(self, *a, **kw):
        self.leases += 1
        self.threads.add(threading.current_thread().name)
        return self.client.lease_batch(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.client, name)


def source(groups, *overrides):
    client, broker = inproc_client(groups)
    counting = Counting(client)
    cfg = load_config(None, [f"learner.groups_per_step={WANT}", *overrides])
    return BrokerBatchSource(counting, cfg, 0, 1), counting, broker.state


def ids(leased):
    return [g.group_id for g in leased.groups]


def test_a_batch_leased_ahead_is_handed_over_without_another_lease():
    groups = synthetic_groups(12)
    src, counting, state = source(groups)
    prefetch = Prefetch(src)
    try:
        first = prefetch.take(1, 0, lambda: False)  # nothing prefetched yet: an ordinary lease
        prefetch.start(2, 1, lambda: False)  # step 1 publishes version 1: step 2 trains at it
        src.ack(first, 1)
        before = counting.leases
        second = prefetch.take(2, 1, lambda: False)
        assert counting.leases == before and ids(second) == [g.group_id for g in groups[WANT : 2 * WANT]]
        assert any(name.startswith("fleetrl-prefetch") for name in counting.threads)
        assert second.lease_s >= second.wait_s >= 0.0 and prefetch.given_back == 0
        src.ack(second, 2)
        assert state.counters["groups_trained"] == 2 * WANT and len(state.queued) == 12 - 2 * WANT
    finally:
        prefetch.close(2)


@pytest.mark.parametrize("change", ["version", "quarantine", "step"])
def test_a_batch_judged_against_what_changed_goes_back_and_the_step_leases_again(change):
    groups = synthetic_groups(8)
    src, counting, state = source(groups)
    prefetch = Prefetch(src)
    try:
        prefetch.start(1, 0, lambda: False)
        prefetch.pending[0].result(10)  # leased
        version, step = 0, 1
        if change == "version":
            version = 1  # a rollback or a resume published a version the lease was not judged against
        elif change == "quarantine":
            src.quarantine("r9")
        else:
            step = 2
        before = counting.leases
        leased = prefetch.take(step, version, lambda: False)
        assert prefetch.given_back == 1 and counting.leases == before + 1
        # the given-back groups went to the front of the queue: the fresh lease holds the same ones
        assert ids(leased) == [g.group_id for g in groups[:WANT]]
        src.ack(leased, step)
        assert state.counters["groups_trained"] == WANT and len(state.queued) == 8 - WANT
        assert not state.batches.leases  # the given-back lease is closed
    finally:
        prefetch.close(1)


def test_cancel_ends_a_lease_waiting_for_groups_and_gives_back_a_held_one():
    src, counting, state = source([])
    prefetch = Prefetch(src)
    try:
        prefetch.start(1, 0, lambda: False)  # no groups queued: the lease waits
        time.sleep(0.1)
        t0 = time.monotonic()
        prefetch.cancel(0)
        # within one short long-poll slice (CANCEL_SLICE_S), not the 2 s an ordinary lease request waits
        assert time.monotonic() - t0 < 1.0 and prefetch.pending is None and not state.batches.leases
    finally:
        prefetch.close(0)

    groups = synthetic_groups(6)
    src, counting, state = source(groups)
    prefetch = Prefetch(src)
    prefetch.start(1, 0, lambda: False)
    prefetch.pending[0].result(10)
    prefetch.close(0)  # training ended with a batch held: it goes back
    assert state.counters["groups_trained"] == 0 and len(state.queued) == 6 and not state.batches.leases


def test_a_lease_error_or_a_stop_on_the_thread_is_raised_by_take():
    src, _, _ = source([], "learner.batch_wait_s=0.3")
    prefetch = Prefetch(src)
    try:
        prefetch.start(1, 0, lambda: False)
        with pytest.raises(FleetIdle, match="learner.batch_wait_s=0.3"):
            prefetch.take(1, 0, lambda: False)
        stop = threading.Event()
        prefetch.start(1, 0, stop.is_set)
        stop.set()
        with pytest.raises(Interrupted):
            prefetch.take(1, 0, stop.is_set)
    finally:
        prefetch.close(1)


def test_prefetch_from_config():
    assert load_config(None, []).learner.prefetch is True
    assert load_config(None, ["learner.prefetch=false"]).learner.prefetch is False


def test_a_lease_ahead_holding_a_group_being_trained_waits_for_the_step_ack_and_none_is_trained_twice():
    """A broker restart forgets the open lease of the batch being trained and queues its groups again; the lease
    ahead gets them. It gives them back, waits for the step's (late) acknowledgement, which consumes them from
    the queue, and leases the next groups: the chaos run that killed the broker mid-spool-write trained 4 groups
    twice before."""
    groups = synthetic_groups(12)
    src, counting, state = source(groups)
    prefetch = Prefetch(src)
    try:
        training = src.next(1)
        ((lease_id, trained_ids),) = training.leases
        # the broker restarted: the lease is only in its history (from the spool), its groups are queued again
        lease = state.batches.leases.pop(lease_id)
        state.batches.history[lease_id] = (lease.client_id, list(lease.group_ids))
        state.q.requeue_front(list(lease.group_ids))
        prefetch.start(2, 1, lambda: False, training.groups)
        wait_s = 0.0
        while prefetch.released == 0 and wait_s < 10:
            time.sleep(0.01)
            wait_s += 0.01
        assert prefetch.released == 1 and not prefetch.pending[0].done()  # waits for the step's acknowledgement
        src.ack(training, 1)  # late: takes back the groups queued again
        prefetch.step_acked()
        second = prefetch.take(2, 1, lambda: False)
        assert not set(ids(second)) & set(trained_ids)
        assert ids(second) == [g.group_id for g in groups[WANT : 2 * WANT]]
        src.ack(second, 2)
        assert state.counters["groups_trained"] == 2 * WANT and len(state.queued) == 12 - 2 * WANT
    finally:
        prefetch.close(2)
