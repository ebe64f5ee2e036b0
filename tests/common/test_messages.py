"""Wire messages: round trip of every type, and one typed error for every kind of bad frame."""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
import pytest

from fleetrl.common import messages as m


def make_group(n: int = 4, t: int = 16, gid: str = "g1", version: int = 3) -> m.SampleGroup:
    rng = np.random.default_rng(0)
    return m.build_group(
        gid,
        "0:7",
        version,
        [5, 6, 7],
        [(rng.integers(0, 100, t), -rng.random(t)) for _ in range(n)],
        rewards=[float(i) for i in range(n)],
        finish_reasons=["stop"] + ["length"] * (n - 1),
        reward_parts=[{"exact": float(i)} for i in range(n)],
        trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        created_at=1.5,
        metadata={"answer": "12"},
    )


def examples() -> list[msgspec.Struct]:
    weights = m.WeightsInfo(
        transport="gloo",
        master_addr="127.0.0.1",
        master_port=29500,
        round_id=2,
        buckets=[[m.ParamSpec(name="w", shape=[2, 3], dtype="float32")]],
    )
    return [
        m.Register(req_id=1, client_id="r0", role="rollout", rank=2, info={"host": "h"}),
        m.Heartbeat(req_id=2, client_id="r0", policy_version=4, stats={"tokens_per_s": 10.5}),
        m.LeasePrompts(req_id=3, client_id="r0", n=8, policy_version=1),
        m.PushGroup(req_id=4, client_id="r0", group=make_group()),
        m.ReturnPrompts(req_id=5, client_id="r0", lease_id="L1", prompt_ids=["0:1"]),
        m.LeaseBatch(req_id=6, client_id="l0", n=16, wait_s=2.0, min_groups=4),
        m.AckBatch(req_id=7, client_id="l0", lease_id="B1", step=3, group_ids=["g1"]),
        m.Commit(req_id=8, client_id="l0", step=10),
        m.Rewind(req_id=9, client_id="l0", step=10),
        m.PublishVersion(req_id=10, client_id="l0", version=5, step=5, weights=weights),
        m.Control(req_id=11, client_id="l0", action="discard", reason="rollback", min_version=3, max_version=6),
        m.GetStatus(req_id=12),
        m.GetVersion(req_id=13, client_id="r0"),
        m.Leave(req_id=14, client_id="l0", reason="training finished", done=True),
        m.ReturnPrompts(req_id=15, client_id="r0", lease_id="L1", prompt_ids=["0:2"], unscored=True),
    ]


def reply_examples() -> list[msgspec.Struct]:
    return [
        m.Ack(req_id=1, ref="g1", count=2, duplicate=True),
        m.Error(req_id=2, code="invalid_group", reason="bad"),
        m.Throttle(req_id=3, retry_after_s=0.5, reason="queue full"),
        m.Registered(req_id=4, broker_id="b", policy_version=2, vocab_size=263, paused=True),
        m.PromptLease(
            req_id=5,
            lease_id="L",
            prompts=[
                m.Prompt(prompt_id="0:1", prompt="1+1=", answer="2"),
                m.Prompt(prompt_id="0:2", prompt=[{"role": "user", "content": "hi"}]),
            ],
            expires_in_s=30.0,
            policy_version=2,
        ),
        m.BatchLease(req_id=6, lease_id="B", groups=[make_group()], expires_in_s=60.0, dropped_stale=1),
        m.CurrentVersion(req_id=7, version=3, step=3, weights=m.WeightsInfo(transport="filesystem", path="/w/3")),
        m.Status(
            req_id=8,
            broker_id="b",
            uptime_s=1.0,
            policy_version=1,
            queue_depth=2,
            groups_in_flight=1,
            prompts_leased=3,
            groups_in=4,
            groups_out=5,
            groups_in_per_s=1.0,
            groups_out_per_s=2.0,
            dropped_stale=1,
            duplicates=1,
            rejected={"invalid_group": 2},
            staleness_hist={"0": 3},
            clients=[m.ClientInfo(client_id="r0", role="rollout", stats={"a": 1.0})],
        ),
    ]


@pytest.mark.parametrize("msg", examples(), ids=lambda x: type(x).__name__)
def test_request_round_trip(msg):
    assert m.decode_request(m.encode(msg)) == msg


@pytest.mark.parametrize("msg", reply_examples(), ids=lambda x: type(x).__name__)
def test_reply_round_trip(msg):
    assert m.decode_reply(m.encode(msg)) == msg


def test_announcement_round_trip():
    for msg in (
        m.VersionAnnouncement(version=3, step=3, weights=m.WeightsInfo(transport="filesystem", path="/x")),
        m.ControlAnnouncement(action="pause", reason="rollback"),
    ):
        assert m.decode_announcement(m.encode(msg)) == msg


def test_arrays_are_raw_little_endian_bytes_and_decode_zero_copy():
    g = make_group(n=3, t=5)
    assert g.lengths == [5, 5, 5] and g.num_tokens == 15 and g.offsets().tolist() == [0, 5, 10, 15]
    assert g.response_tokens(1).tolist() == g.token_array()[5:10].tolist()
    assert m.pack_tokens([1, 258]) == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    assert m.unpack_logprobs(m.pack_logprobs([-0.5])).tolist() == [-0.5]
    frame = m.encode(m.PushGroup(req_id=1, client_id="r", group=g))
    back = m.decode_request(frame).group
    assert isinstance(back.tokens, memoryview) and back.tokens.obj is frame  # a view into the frame, no copy
    assert back.logprob_array().tolist() == g.logprob_array().tolist() and back.finish_reason(1) == "length"
    # 8 responses x 512 tokens x (4 + 4) bytes = 32 KiB of payload, little framing on top
    big = m.build_group("g", "0:1", 0, [1], [(np.zeros(512), np.zeros(512))] * 8, [0.0] * 8)
    assert 32768 < len(m.encode(m.PushGroup(req_id=1, client_id="r", group=big))) < 33000


def test_requests_and_replies_do_not_cross():
    with pytest.raises(m.ProtocolError, match="unknown message tag 20"):
        m.decode_request(m.encode(m.Ack(req_id=1)))
    with pytest.raises(m.ProtocolError):
        m.decode_reply(m.encode(m.GetStatus(req_id=1)))


def _raw_push() -> list:
    return msgspec.msgpack.decode(m.encode(m.PushGroup(req_id=1, client_id="r", group=make_group())))


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda g: g.__setitem__(7, [0.0, math.nan, 1.0, 2.0]), "reward that is not finite"),
        (lambda g: g.__setitem__(7, [0.0, 1.0, math.inf, 2.0]), "reward that is not finite"),
        (lambda g: g.__setitem__(7, [0.0, 1.0]), "4 responses but 2 rewards"),
        (lambda g: g.__setitem__(6, g[6][:-4]), "64 tokens but 63 log-probs"),
        (lambda g: g.__setitem__(5, g[5][:-1]), "tokens holds 255 bytes"),
        (lambda g: g.__setitem__(4, [16, 16, 16, 17]), "lengths sum to 65 tokens"),
        (lambda g: g.__setitem__(4, [16, 16, 40, -8]), "negative response length"),
        (lambda g: g.__setitem__(8, ["stop"]), "4 responses but 1 finish_reasons"),
        (lambda g: g.__setitem__(8, ["stop", "stop", "nope", "stop"]), "Invalid enum value 'nope'"),
        (lambda g: [g.__setitem__(i, []) for i in (4, 7, 8, 9)], "has no responses"),
        (lambda g: g.__setitem__(3, b""), "prompt_tokens is 0 bytes"),
        (lambda g: g.__setitem__(2, "three"), "Expected `int`, got `str`"),
        (lambda g: g.__setitem__(2, -1), "policy_version -1 outside [0, 2147483647]"),
        (lambda g: g.__setitem__(2, 2**64 - 1), "outside [0, 2147483647]"),  # it crashed the learner (long long)
        (
            lambda g: g.__setitem__(7, [0.0, 1e39, 1.0, 2.0]),
            "beyond the float32 range",
        ),  # inf in float32: NaN advantages
    ],
)
def test_bad_groups_raise_protocol_error_with_reason(mutate, reason):
    raw = _raw_push()
    mutate(raw[3])
    with pytest.raises(m.ProtocolError) as e:
        m.decode_request(msgspec.msgpack.encode(raw))
    assert reason in e.value.reason


def test_group_that_is_not_a_group():
    raw = _raw_push()
    raw[3] = "not a group"
    with pytest.raises(m.ProtocolError, match="Expected `array`, got `str`"):
        m.decode_request(msgspec.msgpack.encode(raw))


def test_random_and_truncated_frames_only_raise_protocol_error():
    rng = random.Random(0)
    good = m.encode(m.PushGroup(req_id=1, client_id="r", group=make_group()))
    frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(1000)]
    frames += [good[:k] for k in range(0, len(good), 97)]
    frames += [bytes(b ^ 0xFF if rng.random() < 0.01 else b for b in good) for _ in range(50)]
    errors = 0
    for frame in frames:
        for decode in (m.decode_request, m.decode_reply, m.decode_announcement):
            try:
                decode(frame)
            except m.ProtocolError as e:
                assert e.reason
                errors += 1
    assert errors > 2900  # almost every frame is rejected; none raised anything else


def test_check_group_finds_vocab_and_logprob_problems():
    g = make_group(t=4)
    assert m.check_group(g, vocab_size=100) is None
    assert "outside the vocabulary of 50" in m.check_group(g, vocab_size=50)
    lp = g.logprob_array().copy()
    lp[2] = math.nan
    assert "not finite" in m.check_group(msgspec.structs.replace(g, logprobs=lp.tobytes()))
    lp[2] = -math.inf
    assert "not finite" in m.check_group(msgspec.structs.replace(g, logprobs=lp.tobytes()))
    g3 = msgspec.structs.replace(g, prompt_tokens=m.pack_tokens([-3]))
    assert "negative token id -3" in m.check_group(g3)


def test_loss_mask_and_token_versions_travel_zero_copy_and_default_when_absent():
    g = m.build_group(
        "g",
        "p",
        3,
        [1, 2],
        [([5, 6, 7], [-1, -2, -3]), ([8], [-0.5])],
        [1.0, 0.0],
        loss_masks=[[1, 0, 1], [1]],
        token_versions=[[3, 4, 4], [5]],
    )
    back = m.decode_request(m.encode(m.PushGroup(req_id=1, client_id="c", group=g))).group
    assert back.loss_mask_array().tolist() == [1, 0, 1, 1]
    assert back.version_array().tolist() == [3, 4, 4, 5]
    assert isinstance(back.loss_mask, memoryview) and m.check_group(back) is None
    plain = m.decode_group(m.encode(m.build_group("h", "p", 2, [1], [([5, 6], [-1, -1])], [1.0])))
    assert plain.loss_mask_array().tolist() == [1, 1] and plain.version_array().tolist() == [2, 2]


def test_bad_loss_mask_or_token_versions_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="loss_mask of 2 bytes"):
        m.build_group("g", "p", 3, [1], [([5, 6, 7], [-1, -2, -3])], [1.0], loss_masks=[[1, 0]])
    with pytest.raises(ValueError, match="token_versions of 4 bytes"):
        m.build_group("g", "p", 3, [1], [([5, 6], [-1, -2])], [1.0], token_versions=[[3]])
    older = m.build_group("g", "p", 3, [1], [([5], [-1])], [1.0], token_versions=[[2]])
    assert "oldest version" in m.check_group(older)
    assert "0 or 1" in m.check_group(m.build_group("g", "p", 3, [1], [([5], [-1])], [1.0], loss_masks=[[2]]))


def test_the_remax_baseline_is_a_typed_field_an_old_frame_decodes_without_it_and_a_nan_one_is_refused():
    from tests.helpers import make_group

    g = make_group("0:1")
    plain = m.encode(m.PushGroup(req_id=1, client_id="r0", group=g))
    assert m.decode_request(plain).group.baseline_reward is None  # omitted when unset: a frame from before issue 24
    g.baseline_reward = 0.25
    assert m.decode_request(m.encode(m.PushGroup(req_id=1, client_id="r0", group=g))).group.baseline_reward == 0.25
    g.baseline_reward = float("nan")
    with pytest.raises(m.ProtocolError, match="baseline_reward"):
        m.decode_request(m.encode(m.PushGroup(req_id=1, client_id="r0", group=g)))


def test_per_sample_prompts_round_trip_and_frames_without_them_decode_as_before():
    """Issue 28: a group whose samples' prompts differ carries each one (``prompt_lengths``)."""
    g = m.build_group(
        "g", "p", 0, [[1, 2, 3], [4]], [([5, 6], [-1, -2]), ([7], [-0.5])], [1.0, 0.0], per_sample_prompts=True
    )
    back = m.decode_group(m.encode(g))
    assert (
        back.prompt_lengths == [3, 1] and back.prompt_of(0).tolist() == [1, 2, 3] and back.prompt_of(1).tolist() == [4]
    )
    assert m.check_group(back) is None
    old = msgspec.msgpack.decode(m.encode(m.build_group("h", "p", 0, [1, 2], [([5], [-1])], [1.0])))[:-1]
    shared = m.decode_group(msgspec.msgpack.encode(old))  # a frame of the code before the field: one entry short
    assert shared.prompt_lengths == [] and shared.prompt_of(0).tolist() == [1, 2] and shared.prompt_offsets() is None
    raw = msgspec.msgpack.decode(m.encode(g))
    for bad in ([3], [3, 2], [4, 0]):
        raw[-1] = bad
        with pytest.raises(m.ProtocolError, match="prompt_lengths"):
            m.decode_group(msgspec.msgpack.encode(raw))
