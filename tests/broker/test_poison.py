"""Nothing poisoned gets through (issue 16): huge rewards, versions from the future, unleased prompts,
positive log-probs, empty responses; rollouts rejoin with the current weights; bounded tables and frames.

Each of these was a reproduction first: 1e39 passed the float64 finite check and became inf in float32
(NaN advantages, the run stopped); policy_version 2^64-1 crashed the learner three times; a future
version was never stale; 10^6 groups in one frame blocked the broker for 14.8 s; 400k clients cost
40 % of a core; 20k discard ranges made a push take 507 ms.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.broker.server.test_state import lease_prompts, publish, push
from tests.helpers import make_group


def raw_push(group: m.SampleGroup, **fields) -> bytes:
    raw = msgspec.msgpack.decode(m.encode(m.PushGroup(req_id=1, client_id="r0", group=group)))
    names = list(m.SampleGroup.__struct_fields__)
    for name, value in fields.items():
        raw[3][names.index(name)] = value
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("rewards", [1e39, 0.0], "float32 range"),
        ("policy_version", 2**64 - 1, "outside [0, 2147483647]"),
        ("policy_version", 2**31, "outside [0, 2147483647]"),
    ],
)
def test_poisoned_values_are_refused_at_decode(field, value, reason):
    with pytest.raises(m.ProtocolError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        m.decode_request(raw_push(make_group("0:0"), **{field: value}))


def test_poisoned_groups_are_refused_at_ingest(state):
    publish(state, 0)  # a version is known (published, or recovered from the spool)
    prompt = lease_prompts(state, 1).prompts[0].prompt_id
    big = make_group(prompt, rewards=[2e6, 0.0])
    assert "broker.max_abs_reward" in push(state, big).reason
    future = make_group(prompt, version=1)  # a future version was never stale: lag is clamped at 0
    assert "ahead of the broker's newest version 0" in push(state, future).reason
    positive = m.build_group("gp", prompt, 0, [1, 2], [([5, 6], [-0.5, 0.25])], [1.0])
    assert "log-prob of 0.25 > 0" in push(state, positive).reason
    empty = m.build_group("ge", prompt, 0, [1, 2], [([5], [-0.5]), ([], [])], [1.0, 0.0])
    assert "empty response" in push(state, empty).reason
    versions = m.build_group("gv", prompt, 0, [1, 2], [([5, 6], [-0.5, -0.5])], [1.0], token_versions=[[0, 7]])
    assert "ahead of the broker's newest version" in push(state, versions).reason
    unleased = make_group("0:49")
    assert "never leased" in push(state, unleased).reason
    assert state.rejected["invalid_group"] == 6 and not state.groups and state.prompts.leased == 1
    assert push(state, make_group(prompt)).count == 1  # the prompt is still open: a good group is taken


def test_the_first_check_is_skipped_until_a_version_is_known():
    state = make_state()  # no spool, nothing published: a restarted broker must not refuse the fleet's groups
    prompt = lease_prompts(state, 1).prompts[0].prompt_id
    assert push(state, make_group(prompt, version=57)).count == 1


def test_unleased_groups_are_accepted_when_configured_and_count_against_capacity():
    state = make_state("broker.accept_unleased=true", "broker.max_staleness=0", "algorithm.off_policy.mode=none")
    assert state.capacity == 4
    results = [push(state, make_group(f"0:{i}")) for i in range(6)]
    assert [type(r).__name__ for r in results] == ["Ack"] * 4 + ["Throttle"] * 2  # admission applies to pushes
    assert state.counters["push_throttled"] == 2 and len(state.groups) == 4


def test_a_future_or_rejoining_rollout_is_held_until_it_holds_the_current_weights():
    state = make_state("broker.max_staleness=4")
    publish(state, 5)
    ahead = lease_prompts(state, 1, version=9)
    assert isinstance(ahead, m.Throttle) and "ahead of the broker's 5" in ahead.reason  # never "fresh" forever
    state.handle(m.Register(req_id=1, client_id="r-new", role="rollout"), 0.0)
    behind = lease_prompts(state, 1, client="r-new", version=3)  # within max_staleness, but it (re)joined behind
    assert isinstance(behind, m.Throttle) and "holds the current weights (version 5)" in behind.reason
    assert isinstance(lease_prompts(state, 1, client="r-new", version=5), m.PromptLease)
    assert isinstance(lease_prompts(state, 1, client="r-new", version=3), m.PromptLease)  # admitted: staleness rules


def test_client_table_is_bounded_and_evicts_dead_clients():
    state = make_state("broker.max_clients=3", "broker.client_timeout_s=10")
    for i in range(3):
        assert isinstance(state.handle(m.Register(req_id=1, client_id=f"c{i}", role="rollout"), float(i)), m.Registered)
    full = state.handle(m.Register(req_id=1, client_id="c3", role="rollout"), 5.0)
    assert (
        full.code == "unavailable" and "broker.max_clients=3" in full.reason and state.rejected["too_many_clients"] == 1
    )
    assert isinstance(state.handle(m.Register(req_id=1, client_id="c3", role="rollout"), 10.5), m.Registered)
    assert len(state.clients) == 3 and state.clients.get("c0") is None and state.clients.evicted == 1  # c0 was dead
    state.expire(1000.0)  # silent for 10 x client_timeout_s: evicted anyway
    assert len(state.clients) == 0 and state.counters["clients_evicted"] == 3


def test_register_info_and_heartbeat_stats_are_bounded():
    state = make_state("broker.max_client_info_bytes=1024")
    huge = state.handle(m.Register(req_id=1, client_id="c", role="rollout", info={"k": "x" * 2000}), 0.0)
    assert huge.code == "too_large" and "broker.max_client_info_bytes=1024" in huge.reason
    state.handle(m.Register(req_id=1, client_id="c", role="rollout"), 0.0)
    stats = {f"s{i}": 1.0 for i in range(200)}
    assert state.handle(m.Heartbeat(req_id=1, client_id="c", stats=stats), 0.0).code == "too_large"
    assert state.clients["c"].stats == {} and state.rejected["too_large"] == 2


def test_pushes_beyond_the_frame_and_memory_caps_are_refused():
    state = make_state("broker.max_groups_per_push=8", "broker.max_held_groups=5", "broker.queue_capacity=100")
    lease = lease_prompts(state, 20)
    groups = [make_group(p.prompt_id) for p in lease.prompts]
    many = state.handle(m.PushGroups(req_id=1, client_id="r0", groups=groups[:9]), 0.0)
    assert many.code == "too_large" and "broker.max_groups_per_push=8" in many.reason and not state.groups
    acks = state.handle(m.PushGroups(req_id=1, client_id="r0", groups=groups[:8]), 0.0).acks
    assert [a.status for a in acks] == ["accepted"] * 5 + ["throttled"] * 3  # held groups capped at 5
    assert state.status(0, 0.0).counters["push_throttled"] == 3


def test_a_push_frame_of_a_million_groups_is_refused_before_decoding():
    g = make_group("0:0", n=1, t=1)
    one = m.encode(g)
    frame = msgspec.msgpack.encode([m.PushGroups.__struct_config__.tag, 5, "r0"])[: -0 or None]
    body = (
        b"\x94" + frame[1:] + b"\xdd" + (10**6).to_bytes(4, "big") + one * 10**6
    )  # [tag, req_id, client, [10^6 groups]]
    assert m.peek_push_count(body) == 10**6 and m.peek_header(body) == (14, 5)
    t0 = time.perf_counter()
    for _ in range(100):
        m.peek_push_count(body)
    assert time.perf_counter() - t0 < 0.1  # O(1): the broker refuses it without decoding 10^6 groups


def test_discard_ranges_merge_and_membership_stays_cheap(state):
    publish(state, 40_001)
    for v in range(0, 40_000, 2):  # 20k discards, as a rollback loop would send them
        state.handle(m.Control(req_id=1, client_id="l0", action="discard", min_version=v, max_version=v + 1), 0.0)
    assert state.discarded_versions == [(0, 40_000 - 1)]
    prompt = lease_prompts(state, 1, version=40_001).prompts[0].prompt_id
    t0 = time.perf_counter()
    assert push(state, make_group(prompt, version=40_001)).count == 1
    assert time.perf_counter() - t0 < 0.05  # was 507 ms with 20k ranges checked one by one


def test_log_probs_of_appended_tokens_may_be_zero(state):
    prompt = lease_prompts(state, 1).prompts[0].prompt_id
    g = m.build_group("ga", prompt, 0, [1, 2], [([5, 6, 7], [-0.5, 0.0, 0.0])], [1.0], loss_masks=[np.array([1, 0, 0])])
    assert push(state, g).count == 1


def test_ids_longer_than_the_limit_are_refused_at_decode():
    """Issue 31: 60 client ids of 16 MiB took the broker to 1 GB RSS, and 50 stale groups with 16 MiB ids
    left +832 MB in the dedupe window. Ids are at most MAX_ID_CHARS now, checked at decode."""
    long = "x" * (m.MAX_ID_CHARS + 1)
    ok = "y" * m.MAX_ID_CHARS
    frames = {
        "client_id": lambda i: m.Register(req_id=1, client_id=i, role="rollout"),
        "group_id": lambda i: m.PushGroup(req_id=1, client_id="r0", group=make_group("0:0", gid=i)),
        "prompt_id": lambda i: m.PushGroup(req_id=1, client_id="r0", group=make_group(i)),
        "lease_id": lambda i: m.ReturnPrompts(req_id=1, client_id="r0", lease_id=i),
        "group_ids": lambda i: m.AckBatch(req_id=1, client_id="l0", lease_id="l", group_ids=["a", i]),
    }
    for make in frames.values():
        assert m.decode_request(m.encode(make(ok)))  # at the limit: served
        with pytest.raises(m.ProtocolError, match=f"at most {m.MAX_ID_CHARS} characters"):
            m.decode_request(m.encode(make(long)))
