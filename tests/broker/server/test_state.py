"""The broker's protocol on the state machine itself: leases, ingest, staleness, commits."""

from __future__ import annotations

import pytest

from fleetrl.broker.server.staleness import admission_capacity, min_fresh_version, rollout_is_fresh, staleness
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.helpers import make_group


def lease_prompts(state, n, client="r0", version=0, now=0.0):
    return state.handle(m.LeasePrompts(req_id=1, client_id=client, n=n, policy_version=version), now)


def push(state, group, client="r0", now=0.0):
    return state.handle(m.PushGroup(req_id=2, client_id=client, group=group), now)


def lease_batch(state, n, client="l0", now=0.0, wait_s=0.0, min_groups=1):
    return state.handle(m.LeaseBatch(req_id=3, client_id=client, n=n, wait_s=wait_s, min_groups=min_groups), now)


def ack(state, lease, step=1, client="l0", now=0.0, ids=None):
    ids = ids if ids is not None else [g.group_id for g in lease.groups]
    return state.handle(m.AckBatch(req_id=4, client_id=client, lease_id=lease.lease_id, step=step, group_ids=ids), now)


def publish(state, version, now=0.0):
    return state.handle(m.PublishVersion(req_id=5, client_id="l0", version=version, step=version), now)


def fill(state, n, version=0, now=0.0):
    lease = lease_prompts(state, n, version=version, now=now)
    groups = [make_group(p.prompt_id, version=version) for p in lease.prompts]
    for g in groups:
        assert push(state, g, now=now).count == 1
    return groups


def test_staleness_functions():
    assert min_fresh_version(10, 2) == 8 and min_fresh_version(3, 0) == 3
    assert staleness(5, 3) == 2 and staleness(3, 5) == 0  # a group from a rolled-back future lags 0
    assert admission_capacity(16, 1, 0) == 16 and admission_capacity(16, 2, 2) == 96
    assert rollout_is_fresh(5, 3, 2) and not rollout_is_fresh(5, 2, 2)


def test_happy_path_lease_push_lease_ack(state):
    lease = lease_prompts(state, 3)
    assert isinstance(lease, m.PromptLease) and [p.prompt_id for p in lease.prompts] == ["0:0", "0:1", "0:2"]
    assert lease.prompts[0].prompt == "00+01=" and lease.prompts[0].answer == "1"
    for p in lease.prompts:
        assert push(state, make_group(p.prompt_id)).count == 1
    assert state.prompts.leased == 0 and not state.prompts.leases
    batch = lease_batch(state, 2)
    assert isinstance(batch, m.BatchLease) and len(batch.groups) == 2
    assert ack(state, batch).count == 2
    assert len(state.groups) == 1 and len(state.queued) == 1
    st = state.status(0, 1.0)
    assert (st.groups_in, st.groups_out, st.queue_depth, st.staleness_hist) == (3, 2, 1, {"0": 2})


def test_duplicate_push_is_acked_and_enqueued_once(state):
    lease = lease_prompts(state, 1)
    g = make_group(lease.prompts[0].prompt_id)
    first, again = push(state, g), push(state, g)
    assert (first.count, first.duplicate) == (1, False) and again.duplicate
    assert len(state.queued) == 1 and state.counters["duplicates"] == 1
    batch = lease_batch(state, 4)
    ack(state, batch)
    assert push(state, g).duplicate  # still remembered after it was consumed
    assert not state.queued


@pytest.mark.parametrize("token, reason", [(100, "outside the vocabulary of 100"), (-1, "negative token id")])
def test_invalid_groups_are_refused_and_change_nothing(state, token, reason):
    lease = lease_prompts(state, 1)
    bad = make_group(lease.prompts[0].prompt_id, token=token)
    reply = push(state, bad)
    assert isinstance(reply, m.Error) and reply.code == "invalid_group" and reason in reply.reason
    assert state.rejected["invalid_group"] == 1 and not state.groups and state.prompts.leased == 1
    good = make_group(lease.prompts[0].prompt_id)
    assert push(state, good).count == 1  # the prompt is still open and the next push works


def test_bad_lease_sizes(state):
    assert lease_prompts(state, 0).code == "bad_request"
    assert lease_batch(state, 0).code == "bad_request"


def test_admission_control_throttles_at_capacity():
    state = make_state("broker.max_staleness=1")  # capacity = 4 groups/step * 1 * (1 + 1) = 8
    assert state.capacity == 8
    assert len(lease_prompts(state, 5).prompts) == 5
    assert len(lease_prompts(state, 5).prompts) == 3  # partial grant up to capacity
    throttle = lease_prompts(state, 1)
    assert isinstance(throttle, m.Throttle) and "capacity" in throttle.reason and throttle.retry_after_s > 0
    assert state.counters["throttled"] == 1


def test_stale_rollout_is_throttled_until_it_loads_weights():
    state = make_state("broker.max_staleness=1")
    publish(state, 3)
    reply = lease_prompts(state, 1, version=1)
    assert isinstance(reply, m.Throttle) and "too stale" in reply.reason
    assert isinstance(lease_prompts(state, 1, version=2), m.PromptLease)


def test_stale_groups_are_dropped_counted_and_their_prompts_reissued():
    state = make_state("broker.max_staleness=1", "broker.requeue_stale=true")
    groups = fill(state, 3, version=0)
    publish(state, 2)  # version 0 is now 2 behind: too stale
    reply = lease_batch(state, 4)
    assert isinstance(reply, m.Throttle) and state.counters["dropped_stale"] == 3 and not state.groups
    reissued = lease_prompts(state, 3, version=2)
    assert sorted(p.prompt_id for p in reissued.prompts) == sorted(g.prompt_id for g in groups)
    (prompt,) = lease_prompts(state, 1, version=2).prompts
    late = make_group(prompt.prompt_id, version=0)  # a stale group that arrives late is acked, never queued
    assert push(state, late).count == 0 and state.counters["dropped_stale"] == 4


def test_a_lease_ahead_of_the_publish_counts_staleness_from_the_version_it_will_be_trained_at():
    """LeaseBatch.for_version (learner.prefetch): the bound counts from max(for_version, the published version)."""
    state = make_state("broker.max_staleness=1", "broker.requeue_stale=false")
    fill(state, 2, version=0)
    publish(state, 1)  # version 0 is 1 behind: trainable now, but not at version 2
    ahead = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=2, for_version=2), 0.0)
    assert isinstance(ahead, m.Throttle) and state.counters["dropped_stale"] == 2
    fill(state, 2, version=1)
    ahead = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=2, for_version=2), 0.0)
    assert isinstance(ahead, m.BatchLease) and [g.policy_version for g in ahead.groups] == [1, 1]
    assert state.status(0, 1.0).staleness_hist == {"1": 2}  # counted at the version they will be trained at
    behind = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=2, for_version=0), 0.0)  # 0: the published one
    assert isinstance(behind, m.Throttle)
    bad = state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=2, for_version=-1), 0.0)
    assert isinstance(bad, m.Error) and "for_version must be >= 0" in bad.reason


def test_once_a_learner_leases_ahead_admission_counts_a_rollouts_lag_from_the_version_it_trains_at():
    """A rollout on the published weights is one version behind where its groups will be trained: measured
    admission grants it the window less one version (capacity_at(1)), as it would a lagging rollout."""
    state = make_state("broker.max_staleness=2", "broker.admission=measured", n_prompts=400)
    publish(state, 1)
    first = lease_prompts(state, 400, version=1)
    assert state.trains_at == 1 and len(first.prompts) == state.measured.capacity_at(0)
    state.handle(m.ReturnPrompts(req_id=6, client_id="r0", lease_id=first.lease_id), 0.0)
    state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=1, for_version=2), 0.0)  # nothing queued: a throttle
    assert state.trains_at == 2 and state.version == 1
    ahead = lease_prompts(state, 400, version=1)
    assert len(ahead.prompts) == state.measured.capacity_at(1) < state.measured.capacity_at(0)
    publish(state, 2)  # a learner that leases ahead does so every step: the offset holds across its publish
    assert state.trains_at == 3
    state.handle(m.Register(req_id=7, client_id="l1", role="learner"), 0.0)
    assert state.trains_at == 2  # a learner (re)starting may not lease ahead


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_lease_ahead_that_took_its_whole_share_in_filtered_groups_still_leaves_room_to_make_more(max_staleness):
    """Dynamic sampling filtered every group the lease ahead took (a version's whole share): a rollout on the newest
    weights still gets prompts, or the learner would wait for groups no rollout may make (an e2e DAPO run with
    max_staleness 1 hung at step 2 so before the window kept two versions for the newest weights)."""
    state = make_state(f"broker.max_staleness={max_staleness}", "broker.admission=measured", n_prompts=400)
    publish(state, 1)
    state.handle(m.LeaseBatch(req_id=3, client_id="l0", n=1, for_version=2), 0.0)
    state.measured.taken_by_learner(state.measured.capacity_at(max_staleness))  # all taken, all filtered
    reply = lease_prompts(state, 400, version=1)
    assert isinstance(reply, m.PromptLease) and len(reply.prompts) >= state.measured.capacity_at(max_staleness)


def test_a_batch_given_back_goes_to_the_front_untrained_and_a_late_give_back_takes_nothing():
    state = make_state()
    groups = fill(state, 3)
    lease = lease_batch(state, 2)
    back = state.handle(
        m.AckBatch(req_id=4, client_id="l0", lease_id=lease.lease_id, step=1, group_ids=[], give_back=True), 0.0
    )
    assert back.count == 0 and state.counters["groups_trained"] == 0 and not state.batches.leases
    again = lease_batch(state, 3)  # the given-back groups first, in their order, then the one never leased
    assert [g.group_id for g in again.groups] == [g.group_id for g in lease.groups] + [
        g.group_id for g in groups if g.group_id not in {x.group_id for x in lease.groups}
    ]
    state.expire(10_000.0)  # the lease expires: its groups go back by themselves
    late = state.handle(
        m.AckBatch(req_id=4, client_id="l0", lease_id=again.lease_id, step=1, group_ids=[], give_back=True), 10_000.0
    )
    assert late.count == 0 and state.counters["groups_trained"] == 0 and len(state.queued) == 3


def test_synchronous_job_only_trains_current_version():
    state = make_state("broker.max_staleness=0", "algorithm.off_policy.mode=none")
    assert state.capacity == 4
    fill(state, 4, version=0)
    assert isinstance(lease_prompts(state, 1), m.Throttle)  # no work beyond one batch
    batch = lease_batch(state, 4)
    assert isinstance(lease_prompts(state, 1), m.Throttle)  # still training it
    publish(state, 1)
    ack(state, batch)
    assert isinstance(lease_prompts(state, 1, version=0), m.Throttle)  # must load version 1 first
    assert isinstance(lease_prompts(state, 4, version=1), m.PromptLease)


def test_prompt_lease_expiry_reissues_to_another_server(state):
    lease = lease_prompts(state, 2, client="r0", now=0.0)
    assert state.expire(now=10.0)["prompts_reissued"] == 0
    assert state.expire(now=state.bcfg.prompt_lease_s + 1)["prompts_reissued"] == 2
    other = lease_prompts(state, 5, client="r1", now=400.0)
    assert [p.prompt_id for p in other.prompts][:2] == [p.prompt_id for p in lease.prompts]
    assert state.counters["prompts_reissued"] == 2


def test_dead_client_leases_come_back_early(state):
    lease_prompts(state, 2, client="r0", now=0.0)
    state.handle(m.Heartbeat(req_id=9, client_id="r1"), state.bcfg.client_timeout_s + 1)
    assert state.expire(now=state.bcfg.client_timeout_s + 1)["prompts_reissued"] == 2


def test_returned_prompts_are_reissued_first(state):
    lease = lease_prompts(state, 3)
    reply = state.handle(m.ReturnPrompts(req_id=1, client_id="r0", lease_id=lease.lease_id, prompt_ids=["0:1"]), 0.0)
    assert reply.count == 1
    assert [p.prompt_id for p in lease_prompts(state, 2, client="r1").prompts] == ["0:1", "0:3"]


def test_batch_lease_expiry_redelivers(state):
    groups = fill(state, 3)
    first = lease_batch(state, 2, now=0.0)
    assert state.expire(now=state.bcfg.batch_lease_s + 1)["groups_redelivered"] == 2
    again = lease_batch(state, 3, client="l1", now=state.bcfg.batch_lease_s + 2)
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups] + [groups[2].group_id]
    late = ack(state, first)  # the first learner's late ack: nothing left to take back
    assert late.count == 0 and state.counters["late_acks"] == 1


def test_late_ack_salvages_groups_not_yet_redelivered(state):
    fill(state, 2)
    first = lease_batch(state, 2, now=0.0)
    state.expire(now=state.bcfg.batch_lease_s + 1)
    assert ack(state, first).count == 2 and not state.queued and not state.groups


def test_partial_ack_requeues_untrained_groups(state):
    groups = fill(state, 3)
    batch = lease_batch(state, 3)
    assert ack(state, batch, ids=[groups[1].group_id]).count == 1
    assert [g.group_id for g in lease_batch(state, 3).groups] == [groups[0].group_id, groups[2].group_id]


def test_commit_on_checkpoint_and_rewind_replay_exactly_the_uncommitted_groups():
    state = make_state("broker.commit_on_checkpoint=true")
    groups = fill(state, 4)
    for step, pair in ((1, groups[:2]), (2, groups[2:])):
        batch = lease_batch(state, 2)
        assert [g.group_id for g in batch.groups] == [g.group_id for g in pair]
        ack(state, batch, step=step)
    assert len(state.groups) == 4 and not state.queued  # trained but not committed: kept
    assert state.handle(m.Commit(req_id=1, client_id="l0", step=1), 0.0).count == 2
    assert len(state.groups) == 2
    # the learner dies after step 2 and resumes from its checkpoint at step 1
    assert state.handle(m.Rewind(req_id=1, client_id="l0", step=1), 0.0).count == 2
    again = lease_batch(state, 4)
    assert [g.group_id for g in again.groups] == [g.group_id for g in groups[2:]]


def test_rewind_also_returns_open_batch_leases(state):
    groups = fill(state, 2)
    lease_batch(state, 2)
    assert state.handle(m.Rewind(req_id=1, client_id="l0", step=0), 0.0).count == 2
    assert [g.group_id for g in lease_batch(state, 2).groups] == [g.group_id for g in groups]


def test_pause_resume_and_discard_publish_announcements(state):
    fill(state, 2, version=0)
    state.handle(m.Control(req_id=1, client_id="l0", action="pause", reason="rollback"), 0.0)
    assert isinstance(lease_prompts(state, 1), m.Throttle) and state.status(0, 0).paused
    reply = state.handle(m.Control(req_id=1, client_id="l0", action="discard", min_version=0, max_version=0), 0.0)
    assert reply.count == 2 and not state.queued and state.counters["discarded"] == 2
    state.handle(m.Control(req_id=1, client_id="l0", action="resume"), 0.0)
    assert [type(a).__name__ for _, a in state.announcements] == ["ControlAnnouncement"] * 3
    assert len(lease_prompts(state, 2).prompts) == 2  # discarded prompts come back
    assert state.load() == 2  # the two leased again; the discarded groups no longer count against admission


def test_version_publish_and_late_subscriber(state):
    weights = m.WeightsInfo(transport="filesystem", path="/w/v3")
    publish(state, 3)
    state.handle(m.PublishVersion(req_id=1, client_id="l0", version=4, step=4, weights=weights), 0.0)
    cur = state.handle(m.GetVersion(req_id=1, client_id="r9"), 0.0)
    assert (cur.version, cur.weights.path, cur.weights.transport) == (4, "/w/v3", "filesystem")
    reg = state.handle(m.Register(req_id=1, client_id="r9", role="rollout"), 0.0)
    assert reg.policy_version == 4 and reg.weights == cur.weights
    assert reg.weights.published_at > 0  # stamped by the broker: what rollouts order versions by


def test_protocol_mismatch_is_refused(state):
    reply = state.handle(m.Register(req_id=1, client_id="x", role="rollout", protocol=99), 0.0)
    assert reply.code == "protocol_mismatch" and "install matching" in reply.reason


def test_data_exhaustion(tmp_path):
    state = make_state(n_prompts=3, epochs=2)
    seen = []
    for _ in range(2):
        lease = lease_prompts(state, 3)
        seen += [p.prompt_id for p in lease.prompts]
        for p in lease.prompts:
            push(state, make_group(p.prompt_id))
        ack(state, lease_batch(state, 3))
    assert seen == ["0:0", "0:1", "0:2", "1:0", "1:1", "1:2"]
    reply = lease_prompts(state, 1)
    assert isinstance(reply, m.Error) and reply.code == "data_exhausted" and "data.epochs" in reply.reason


def test_long_poll_waits_then_answers():
    state = make_state()
    fill(state, 1)
    assert lease_batch(state, 4, wait_s=5.0, min_groups=2) is None  # the server parks it
    final = state.lease_batch_final(m.LeaseBatch(req_id=1, client_id="l0", n=4, wait_s=5, min_groups=2), 5.0)
    assert isinstance(final, m.BatchLease) and len(final.groups) == 1


def test_status_reports_clients_and_histogram(state):
    state.handle(m.Register(req_id=1, client_id="r0", role="rollout", rank=0), 0.0)
    state.handle(m.Heartbeat(req_id=1, client_id="r0", policy_version=2, stats={"tokens_per_s": 5.0}), 1.0)
    st = state.status(0, 100.0)
    (c,) = st.clients
    assert (c.role, c.policy_version, c.alive, c.stats["tokens_per_s"]) == ("rollout", 2, False, 5.0)
    assert m.to_dict(st)["clients"][0]["client_id"] == "r0"


def test_ack_with_keep_rest_releases_some_groups_and_keeps_the_lease(state):
    groups = fill(state, 3)
    batch = lease_batch(state, 3)
    assert state.in_flight == 3
    reply = state.handle(
        m.AckBatch(
            req_id=1, client_id="l0", lease_id=batch.lease_id, step=1, group_ids=[groups[0].group_id], keep_rest=True
        ),
        0.0,
    )
    assert reply.count == 1 and state.in_flight == 2 and not state.queued  # the rest stays leased, not requeued
    assert ack(state, batch, ids=[g.group_id for g in groups[1:]]).count == 2
    assert state.in_flight == 0 and not state.groups


def test_discarded_versions_stay_discarded_for_late_arrivals(state):
    fill(state, 2, version=0)
    publish(state, 3)
    reply = state.handle(m.Control(req_id=1, client_id="l0", action="discard", min_version=1, max_version=3), 0.0)
    assert reply.count == 0  # the queued ones are version 0: kept
    a, b = lease_prompts(state, 2, version=3).prompts
    late = push(state, make_group(a.prompt_id, version=2))  # generated by a rolled-back version, arriving late
    assert late.count == 0 and state.counters["discarded"] == 1
    publish(state, 4)  # the restored weights, as a new version
    assert push(state, make_group(b.prompt_id, version=4)).count == 1  # ... trains


# ----------------------------------------------------------------------------------- leaving


def register(state, client, role, now=0.0):
    return state.handle(m.Register(req_id=1, client_id=client, role=role), now)


def test_a_client_that_leaves_is_out_of_the_fleet_at_once(state):
    register(state, "r0", "rollout")
    register(state, "r1", "rollout")
    fill(state, 2)  # r0 pushed two groups
    held = lease_prompts(state, 3, client="r1")
    batch = lease_batch(state, 2)
    assert sum(c.role == "rollout" and c.alive for c in state.status(0, 1.0).clients) == 2
    reply = state.handle(m.Leave(req_id=2, client_id="r1", reason="SIGTERM"), 1.0)
    assert reply.count == 3  # its prompt lease re-issued now, not after broker.prompt_lease_s
    st = state.status(0, 1.0)
    assert [c.client_id for c in st.clients if c.role == "rollout"] == ["r0"]  # fleet size 1 at once
    assert [p.prompt_id for p in lease_prompts(state, 3, client="r0").prompts] == [p.prompt_id for p in held.prompts]
    assert state.handle(m.Leave(req_id=3, client_id="l0", reason="stopped"), 1.0).count == 2  # its batch requeued
    assert [g.group_id for g in lease_batch(state, 2, client="l1").groups] == [g.group_id for g in batch.groups]
    assert not [a for _, a in state.announcements if getattr(a, "action", "") == "done"]  # a stop is not `done`


def test_a_learner_that_finished_tells_the_fleet(state):
    register(state, "l0", "learner")
    state.handle(m.Leave(req_id=2, client_id="l0", reason="training finished at step 9", done=True), 0.0)
    [(topic, ann)] = state.announcements
    assert topic == m.TOPIC_CONTROL and ann.action == "done" and ann.reason == "training finished at step 9"
    throttle = lease_prompts(state, 2)  # a server that missed the announcement learns it from its next lease
    assert isinstance(throttle, m.Throttle) and throttle.reason == "done: training finished at step 9"
    register(state, "l0", "learner")  # a new learner (a resume): training goes on
    assert isinstance(lease_prompts(state, 2), m.PromptLease)
    state.announcements.clear()
    state.announce_shutdown()
    assert [a.action for _, a in state.announcements] == ["done"]


def test_unscorable_prompts_are_counted_and_not_reissued(state):
    lease = lease_prompts(state, 3)
    reply = state.handle(
        m.ReturnPrompts(req_id=1, client_id="r0", lease_id=lease.lease_id, prompt_ids=["0:1"], unscored=True), 0.0
    )
    assert reply.count == 1 and state.counters["prompts_unscored"] == 1 and not state.prompts.reissue
    assert state.prompts.leased == 2 and "0:1" not in [
        p.prompt_id for p in lease_prompts(state, 5, client="r1").prompts
    ]
