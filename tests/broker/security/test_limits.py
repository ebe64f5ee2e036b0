"""Limits in bytes (issue 31, item 4 of its list): counts bounded nothing when one item could weigh 16 MiB.

Reproductions at the state machine and the pre-decode checks (the attacks at their full sizes against a real
broker process are in test_abuse_bytes.py, slow lane):
- 40 held groups with 48 MiB metadata gave 3.9 GB RSS (lists of integers expand ~9x when decoded) and one
  1.9 GB LeaseBatch frame;
- 50 stale groups with 16 MiB ids left +832 MB in the dedupe window;
- a GetStatus returned 960 MiB.
"""

from __future__ import annotations

import tracemalloc

import msgspec
import numpy as np

from fleetrl.broker.security.precheck import detach_if_pinning, precheck
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from tests.broker.conftest import make_state
from tests.broker.server.test_state import ack, lease_batch, lease_prompts, push
from tests.helpers import make_group

MIB = 1 << 20


def push_frame(*groups: m.SampleGroup) -> bytes:
    if len(groups) == 1:
        return m.encode(m.PushGroup(req_id=7, client_id="r0", group=groups[0]))
    return m.encode(m.PushGroups(req_id=7, client_id="r0", groups=list(groups)))


def with_fields(g: m.SampleGroup, extra: list | None = None, **fields) -> bytes:
    """A PushGroup frame of ``g`` with every field present, some replaced by raw values, and ``extra`` elements
    appended after the last field (what a newer sender's fields look like to this decoder)."""
    values = dict(zip(m.SampleGroup.__struct_fields__, msgspec.structs.astuple(g)))
    values.update(fields)
    return msgspec.msgpack.encode([m.PushGroup.__struct_config__.tag, 7, "r0", list(values.values()) + (extra or [])])


def check(frame: bytes, *overrides: str):
    bcfg = load_config(None, list(overrides)).broker
    return precheck(memoryview(frame), m.peek_header(frame), 7, bcfg)


def pinning(frame: bytes) -> bool:
    """Whether the server copies the frame's groups out of it after decoding."""
    req = m.decode_request(frame)
    before = [req.group] if isinstance(req, m.PushGroup) else list(req.groups)
    detach_if_pinning(req, len(frame))
    after = [req.group] if isinstance(req, m.PushGroup) else req.groups
    return any(a is not b for a, b in zip(after, before))


def test_group_metadata_is_measured_and_refused_before_decoding():
    """48 MiB of small integers in a group's metadata: refused from its raw size, nothing decoded (it took 430 MB)."""
    n = 48 * MIB
    junk = msgspec.Raw(b"\x81\xa4junk\xdd" + n.to_bytes(4, "big") + b"\x01" * n)  # {"junk": [1, 1, ...]}: 48 Mi ints
    frame = with_fields(make_group("0:0"), metadata=junk)
    assert len(frame) > n
    tracemalloc.start()
    try:
        refusal = check(frame, "broker.max_message_bytes=100000000")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refusal is not None and refusal[1].code == "too_large" and refusal[1].req_id == 7
    assert (
        "broker.max_group_metadata_bytes" in refusal[1].reason and "at least" in refusal[1].reason
    )  # O(1): first fields
    assert peak < MIB, peak  # measured as raw spans: no Python object per integer
    ok = make_group("0:0")
    ok.metadata = {"note": "x" * 1000, "ints": list(range(1000))}
    assert check(push_frame(ok)) is None  # an ordinary group passes
    many = []
    for i in range(9):  # each under the per-group limit, together over 8 x it
        g = make_group(f"0:{i}")
        g.metadata = {"blob": "y" * (MIB - 4096)}
        many.append(g)
    refusal = check(push_frame(*many))
    assert refusal is not None and "together" in refusal[1].reason
    assert check(push_frame(*many[:8])) is None and pinning(push_frame(*many[:8]))  # copied out: mostly metadata
    assert not pinning(push_frame(*[make_group(f"0:{i}", t=5000) for i in range(8)]))  # ordinary frames stay views


def test_small_requests_and_info_frames_are_refused_by_size_before_decoding():
    info = m.encode(m.Register(req_id=3, client_id="r0", role="rollout", info={f"k{i}": "v" * 60 for i in range(2000)}))
    refusal = check(info)
    assert refusal is not None and refusal[0] == "too_large" and "max_client_info_bytes" in refusal[1].reason
    assert check(m.encode(m.Register(req_id=3, client_id="r0", role="rollout", info={"receivers": "1"}))) is None
    acks = m.encode(m.AckBatch(req_id=4, client_id="l0", lease_id="x", group_ids=["g" * 200] * 100_000))
    refusal = check(acks, "broker.max_message_bytes=100000000")
    assert refusal is not None and "tag 7" in refusal[1].reason


def test_held_groups_are_bounded_in_bytes_and_the_budget_comes_back():
    state = make_state("broker.max_held_bytes=1048576", "broker.queue_capacity=40", n_prompts=50)
    prompts = lease_prompts(state, 10).prompts
    heavy = [make_group(p.prompt_id, t=40_000) for p in prompts]  # 2 x 40k tokens x 8 bytes: ~640 KB each
    replies = [push(state, g) for g in heavy]
    accepted = [r for r in replies if isinstance(r, m.Ack) and r.count]
    throttled = [r for r in replies if isinstance(r, m.Throttle)]
    assert len(accepted) == 1 and len(throttled) == 9  # the first one alone; then the budget is full
    assert "broker.max_held_bytes=1048576" in throttled[0].reason
    assert state.q.held_bytes == m.group_nbytes(heavy[0]) > 600_000
    ack(state, lease_batch(state, 10))  # trained: its bytes come back
    assert state.q.held_bytes == 0
    assert isinstance(push(state, heavy[1]), m.Ack)  # a throttled push is taken on a later try


def test_the_default_held_budget_fits_a_step_of_the_job_and_at_least_128_mib():
    small = make_state()
    assert small.max_held_bytes == 128 * MIB and small.max_lease_bytes == small.max_held_bytes
    big = make_state("rollout.max_new_tokens=8192", "rollout.group_size=16", "learner.groups_per_step=512")
    per_group = 13 * 16 * 8192
    assert big.max_held_bytes >= 2 * big.capacity * per_group


def test_the_dedupe_window_is_bounded_in_bytes():
    state = make_state("broker.max_dedupe_bytes=200000")
    q = state.q
    ids = [f"{i:06d}" + "z" * 250 for i in range(2000)]  # 256-character ids, the longest decoding allows
    for gid in ids:
        q.remember(gid)
    assert q.seen_bytes <= 200_000 and len(q.seen) == 200_000 // (256 + 96)
    assert q.knows(ids[-1]) and not q.knows(ids[0])  # the newest are remembered, the oldest forgotten
    q.remember(ids[-1])  # remembering again costs nothing
    assert q.seen_bytes == len(q.seen) * (256 + 96)


def test_status_replies_are_bounded_in_bytes_and_list_the_fleet_first():
    state = make_state(
        "broker.max_clients=5000",
        "broker.max_monitor_clients=5000",
        "broker.max_clients_per_key=5000",
        "broker.key_requests_per_s=1000000",
        "broker.max_client_table_bytes=100000000",
    )
    stats = {f"stat/{i:04d}": float(i) for i in range(300)}  # ~16 KiB of heartbeat stats each, as counted
    for i in range(1200):
        state.handle(m.Register(req_id=1, client_id=f"mon-{i}", role="monitor"), 0.0)
        assert isinstance(state.handle(m.Heartbeat(req_id=2, client_id=f"mon-{i}", stats=stats), 0.0), m.Ack)
    for cid, role in (("rollout-0", "rollout"), ("learner-0", "learner")):
        state.handle(m.Register(req_id=1, client_id=cid, role=role), 1.0)
        state.handle(m.Heartbeat(req_id=2, client_id=cid, stats={"rollout/tokens_per_s": 5.0}), 1.0)
    status = state.handle(m.GetStatus(req_id=9), 2.0)
    size = len(m.encode(status))
    assert size <= 8 * MIB + 64 * 1024, size  # broker.max_status_bytes (was ~10 MB here, 960 MiB in the attack)
    assert [c.client_id for c in status.clients[:2]] == ["learner-0", "rollout-0"]
    assert status.clients[1].stats == {"rollout/tokens_per_s": 5.0}  # the fleet keeps its stats
    assert len(status.clients) == 1202 and status.clients_omitted == 0 and status.stats_omitted > 100
    tight = make_state("broker.max_status_bytes=65536", "broker.key_requests_per_s=1000000")
    for i in range(2000):
        tight.handle(m.Register(req_id=1, client_id=f"mon-{i}" + "x" * 200, role="monitor"), 0.0)
    tight.handle(m.Register(req_id=1, client_id="rollout-0", role="rollout"), 0.0)
    status = tight.handle(m.GetStatus(req_id=9), 1.0)
    assert len(m.encode(status)) <= 65536 + 4096 and status.clients[0].client_id == "rollout-0"
    assert len(tight.clients) == 257  # broker.max_monitor_clients=256: the longest-silent monitors made room
    assert status.clients_omitted == len(tight.clients) - len(status.clients) > 0


def test_batch_and_prompt_leases_are_bounded_in_bytes():
    state = make_state("broker.max_lease_bytes=700000", "broker.queue_capacity=40")
    prompts = lease_prompts(state, 4).prompts
    for p in prompts:
        assert push(state, make_group(p.prompt_id, t=20_000)).count == 1  # ~320 KB each
    first = lease_batch(state, 4)
    assert len(first.groups) == 2 and len(state.q) == 2  # the rest stays queued for the next lease
    assert len(lease_batch(state, 4, client="l1").groups) == 2
    rows = [{"prompt": f"{i}+1=", "answer": "1", "doc": "w" * 200_000} for i in range(10)]
    from fleetrl.broker.server.prompts import PromptSource, rows_to_prompts
    from fleetrl.broker.server.state import BrokerState

    cfg = load_config(None, ["broker.max_lease_bytes=700000", "broker.queue_capacity=40"])
    wide = BrokerState(cfg, PromptSource(rows_to_prompts(rows, "prompt", "answer", "t"), False, 0, 1), vocab_size=100)
    got = [p.prompt_id for p in lease_prompts(wide, 10).prompts]
    assert got == ["0:0", "0:1", "0:2"]  # 3 x ~200 KB fit 700 KB
    assert [p.prompt_id for p in lease_prompts(wide, 2).prompts] == ["0:3", "0:4"]  # the rest come next, in order


def test_a_group_accepted_from_a_frame_of_refused_ones_does_not_pin_the_frame():
    state = make_state("rollout.group_size=2")
    (p,) = lease_prompts(state, 1).prompts
    junk = [make_group(p.prompt_id, t=5000, gid=f"junk-{i}") for i in range(20)]  # all for one prompt: 19 refused
    frame = push_frame(*junk)
    req = m.decode_request(frame)
    reply = state.handle(req, 0.0)
    assert [a.status for a in reply.acks].count("accepted") == 1
    (held,) = state.q.groups.values()
    assert isinstance(held.tokens, bytes)  # copied out: the 19 refused groups' bytes can be freed
    (p2,) = lease_prompts(state, 1).prompts
    alone = m.decode_request(push_frame(make_group(p2.prompt_id, t=5000)))
    state.handle(alone, 0.0)
    assert isinstance(state.q.groups[alone.group.group_id].tokens, memoryview)  # a lone group stays zero-copy


def test_appended_bytes_in_a_push_frame_are_not_pinned_by_its_group():
    g = make_group("0:0", t=100)
    frame = with_fields(g, extra=[0, b"\0" * (4 * MIB)])  # fields a newer (or hostile) sender appended: skipped
    assert check(frame) is None and pinning(frame)  # the server copies the group out of this frame
    assert np.array_equal(m.detached(m.decode_request(frame).group).token_array(), g.token_array())


def test_the_client_tables_info_and_stats_are_bounded_in_bytes_together():
    """4,000 clients reporting 16 KiB of stats each held 400 MB (a decoded entry costs ~7 x its bytes)."""
    state = make_state("broker.max_client_table_bytes=200000", "broker.key_requests_per_s=1000000")
    stats = {f"stat/{i:04d}": float(i) for i in range(300)}  # 14,700 bytes as counted: 13 fit 200,000
    for i in range(40):
        state.handle(m.Register(req_id=1, client_id=f"r{i}", role="rollout"), 0.0)
        assert isinstance(state.handle(m.Heartbeat(req_id=2, client_id=f"r{i}", stats=stats), 0.0), m.Ack)
    kept = [c for c in state.clients.clients.values() if c.stats]
    assert len(kept) == 13 and state.counters["stats_dropped"] == 27 and state.clients.held <= 200_000
    assert state.clients["r39"].last_seen == 0.0  # a heartbeat whose stats were dropped still counts
    state.handle(m.Heartbeat(req_id=2, client_id="r0", stats={}), 1.0)  # r0 reports less: room for one more
    assert isinstance(state.handle(m.Heartbeat(req_id=2, client_id="r39", stats=stats), 1.0), m.Ack)
    assert state.clients["r39"].stats == stats
    monitors = make_state("broker.max_client_table_bytes=100000", "broker.key_requests_per_s=1000000")
    info = {f"k{i:03d}": "v" * 10 for i in range(250)}  # 11,500 bytes of Register info, as counted: 8 fit 100,000
    for i in range(8):
        assert isinstance(
            monitors.handle(m.Register(req_id=1, client_id=f"mon-{i}", role="monitor", info=info), 0.0), m.Registered
        )
    assert (
        monitors.handle(m.Register(req_id=1, client_id="mon-8", role="monitor", info=info), 0.0).code == "unavailable"
    )
    rollout = monitors.handle(m.Register(req_id=1, client_id="rollout-0", role="rollout", info=info), 0.0)
    assert isinstance(rollout, m.Registered) and len(monitors.clients.monitors) == 7  # a monitor made room
