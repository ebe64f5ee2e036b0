"""Hypothesis strategies for wire fuzzing: every request, reply and announcement, as raw msgpack arrays.

Messages are built as plain lists (``[tag, req_id, field, ...]``, the ``array_like`` layout of
``common/messages.py``) rather than as Structs, so that what a Struct would refuse — wrong types,
arrays whose lengths disagree, NaN rewards, ints at the edges of int64/uint64, missing or extra
fields — still reaches the decoder. A message draws well-typed values for its fields, then (about a
quarter of the time) swaps one field for any msgpack value and (a tenth of the time) drops required
fields or appends unknown ones. Groups are built consistent from a seed and then broken in one of
many ways (``GROUP_FAULTS``). :func:`mutate` and :func:`raw_frame` derive more frames from a
``random.Random`` that hypothesis controls: bit flips, truncation, extension, splices, msgpack
type-marker swaps, deep nesting, and readable headers over garbage.

Drawing from hypothesis costs ~0.15 ms a value here, so the strategies draw few values per message
and the cheap seeded mutations multiply each drawn message into several frames.
"""

from __future__ import annotations

import math
import random

import msgspec
import numpy as np
from hypothesis import strategies as st

from fleetrl.common import messages as m

INT_EDGES = [
    -(2**63),
    -(2**31) - 1,
    -(2**31),
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
]
FLOAT_EDGES = [0.0, -0.0, 5e-324, -1e-310, 1e308, -1e308, math.inf, -math.inf, math.nan, 3.4e38, 1e-7]

ints = st.one_of(st.integers(-3, 70), st.sampled_from(INT_EDGES), st.integers(-(2**63), 2**64 - 1))
small_ints = st.one_of(st.integers(-2, 70), st.sampled_from(INT_EDGES))
floats = st.one_of(st.floats(-1e3, 1e3), st.sampled_from(FLOAT_EDGES), st.floats())
# lone surrogates cannot be encoded at all (a sender fails before the wire), so they are left out
texts = st.one_of(
    st.just(""), st.text(max_size=20), st.text(st.characters(codec="utf-8", min_codepoint=0x80), min_size=1, max_size=6)
)
leaf_values = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=16))
any_value = st.recursive(
    leaf_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(texts, small_ints), inner, max_size=3)
    ),
    max_leaves=8,
)

CLIENT_POOL = ["fz-r0", "fz-r1", "fz-l0", "fz-l1", "fz-mon"]
PROMPT_POOL = ["0:0", "0:1", "0:7", "1:3", "0:1999", "0:2000", "7:7", "x:1", ":", "0:-1", "00:01"]
ROLES = ["rollout", "learner", "operator", "monitor"]
# "stop" and "discard" change the broker for good (discard rolls back a version range, late arrivals included),
# which would leave nothing to fuzz after them: test_fuzz.py sends those to a broker of their own
ACTIONS = ["pause", "resume"]
TRANSPORTS = ["filesystem", "gloo", "nccl", "none"]
FINISH = ["stop", "length", "abort"]
VOCAB = 263  # the fuzzed broker's broker.vocab_size

client_ids = st.one_of(st.sampled_from(CLIENT_POOL), st.sampled_from(CLIENT_POOL), texts)
str_maps = st.dictionaries(texts, texts, max_size=3)
float_maps = st.dictionaries(texts, floats, max_size=3)


def finish(draw, fields: list, required: int) -> list:
    """Swap one field for any msgpack value (~25%); drop required fields or add unknown ones (~10%)."""
    fields = list(fields)
    bad = draw(st.integers(0, 4 * max(1, len(fields)) - 1))
    if bad < len(fields):
        fields[bad] = draw(any_value)
    cut = draw(st.integers(0, 19))
    if cut == 0:
        return fields[: draw(st.integers(0, max(0, required - 1)))]
    if cut == 1:
        return fields + draw(st.lists(any_value, min_size=1, max_size=2))
    if cut < 10:  # trailing defaults omitted, as omit_defaults does
        return fields[: draw(st.integers(required, len(fields)))]
    return fields


# ------------------------------------------------------------------------------------ groups

GROUP_FAULTS = [
    "tokens_size",
    "logprobs_size",
    "lengths_sum",
    "negative_length",
    "huge_length",
    "rewards_count",
    "nan_reward",
    "inf_logprob",
    "negative_token",
    "token_over_vocab",
    "empty_group_id",
    "empty_prompt",
    "ragged_prompt",
    "negative_version",
    "finish_literal",
    "parts_count",
    "failed_count",
    "empty_group",
]


@st.composite
def group_fields(draw, max_tokens: int = 48) -> list:
    """A SampleGroup as a raw array: consistent half the time, else broken by one of ``GROUP_FAULTS``."""
    seed, n = draw(st.integers(0, 2**32 - 1)), draw(st.integers(1, 8))
    fault = draw(st.sampled_from(GROUP_FAULTS + [None] * len(GROUP_FAULTS)))
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(0, max_tokens + 1, n)]
    total = sum(lengths)
    tokens = rng.integers(0, VOCAB, total).astype("<i4")
    logprobs = -rng.random(total).astype("<f4")
    prompt = rng.integers(0, VOCAB, int(rng.integers(1, 9))).astype("<i4").tobytes()
    rewards = [float(x) for x in rng.random(n)]
    g = {
        "group_id": draw(st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(["dup-a", "dup-b", "é"]))),
        "prompt_id": draw(st.one_of(st.sampled_from(PROMPT_POOL), texts)),
        "policy_version": draw(st.one_of(st.integers(0, 5), ints)),
        "finish_reasons": [FINISH[i % 3] for i in range(n)] if seed % 2 else [],
        "reward_parts": [{"r": r} for r in rewards] if seed % 3 == 0 else [],
        "failed": [False] * n if seed % 5 == 0 else [],
    }
    if total and fault in ("inf_logprob", "negative_token", "token_over_vocab"):
        i = int(rng.integers(0, total))
        if fault == "inf_logprob":
            logprobs[i] = rng.choice([np.nan, np.inf, -np.inf])
        else:
            tokens[i] = -int(rng.integers(1, 2**31)) if fault == "negative_token" else int(rng.integers(VOCAB, 2**31))
    tok, lp = tokens.tobytes(), logprobs.tobytes()
    if fault == "tokens_size":
        tok = tok[: len(tok) - int(rng.integers(1, 5))] if tok else b"\x00"
    elif fault == "logprobs_size":
        lp += rng.bytes(int(rng.integers(1, 9)))
    elif fault == "lengths_sum":
        lengths[0] += 1
    elif fault == "negative_length":
        lengths[-1] = -lengths[-1] - 1
    elif fault == "huge_length":
        lengths[0] = draw(st.sampled_from([2**31, 2**62, 2**63 - 1, 2**64 - 1]))
    elif fault == "rewards_count":
        rewards = rewards[:-1] if n > 1 else rewards * 2
    elif fault == "nan_reward":
        rewards[int(rng.integers(0, n))] = float(rng.choice([math.nan, math.inf, -math.inf]))
    elif fault == "empty_group_id":
        g["group_id"] = ""
    elif fault == "empty_prompt":
        prompt = b""
    elif fault == "ragged_prompt":
        prompt += b"\x01"
    elif fault == "negative_version":
        g["policy_version"] = -int(rng.integers(1, 2**62))
    elif fault == "finish_literal":
        g["finish_reasons"] = ["eos"] * n
    elif fault == "parts_count":
        g["reward_parts"] = [{}] * (n + 1)
    elif fault == "failed_count":
        g["failed"] = [True] * (n + 2)
    elif fault == "empty_group":
        lengths, rewards, tok, lp = [], [], b"", b""
    fields = [
        g["group_id"],
        g["prompt_id"],
        g["policy_version"],
        prompt,
        lengths,
        tok,
        lp,
        rewards,
        g["finish_reasons"],
        g["reward_parts"],
        g["failed"],
        "",
        "fz",
        {"traceparent": "00-x"},
        1.5,
        draw(st.one_of(st.just({}), st.dictionaries(texts, any_value, max_size=2))),
    ]
    return finish(draw, fields, required=8) if fault is None and seed % 4 == 0 else fields


# ---------------------------------------------------------------------------------- requests

# A held LeaseBatch is answered at wait_s at the latest; the fuzz waits for every reply, so the waits
# drawn here are short (test_fuzz.py sends unbounded ones — inf, 1e300 — on their own).
WAITS = st.one_of(st.sampled_from([0.0, -0.0, -1.0, math.nan, -math.inf, 0.05, 0.2]), st.floats(0, 0.25))

REQUESTS = {  # tag -> (required fields after [tag, req_id], builder of those fields)
    1: (
        2,
        lambda d: [
            d(client_ids),
            d(st.sampled_from(ROLES + ["admin"])),
            d(st.sampled_from([m.PROTOCOL_VERSION] * 3 + INT_EDGES)),
            d(small_ints),
            d(str_maps),
        ],
    ),
    2: (1, lambda d: [d(client_ids), d(ints), d(float_maps)]),
    3: (2, lambda d: [d(client_ids), d(st.one_of(st.integers(-2, 16), st.sampled_from(INT_EDGES))), d(ints)]),
    4: (2, lambda d: [d(client_ids), d(group_fields())]),
    14: (2, lambda d: [d(client_ids), d(st.lists(group_fields(), max_size=3))]),
    5: (2, lambda d: [d(client_ids), d(texts), d(st.lists(st.sampled_from(PROMPT_POOL), max_size=3))]),
    6: (
        2,
        lambda d: [
            d(client_ids),
            d(st.one_of(st.integers(-2, 80), st.sampled_from(INT_EDGES))),
            d(WAITS),
            d(small_ints),
        ],
    ),
    7: (
        2,
        lambda d: [
            d(client_ids),
            d(texts),
            d(ints),
            d(st.lists(st.sampled_from(["dup-a", "dup-b", "x"]), max_size=3)),
            d(st.booleans()),
        ],
    ),
    8: (1, lambda d: [d(client_ids), d(ints)]),
    9: (1, lambda d: [d(client_ids), d(ints)]),
    10: (2, lambda d: [d(client_ids), d(st.one_of(st.integers(0, 6), ints)), d(small_ints), d(weights_fields())]),
    11: (
        2,
        lambda d: [d(client_ids), d(st.sampled_from(ACTIONS + ["reboot"])), d(texts), d(small_ints), d(small_ints)],
    ),
    12: (0, lambda d: [d(client_ids)]),
    13: (0, lambda d: [d(client_ids)]),
}
REQUEST_TAGS = sorted(REQUESTS)


@st.composite
def control_array(draw) -> list:
    """A Control of any action, "stop" and "discard" (of random version ranges) included."""
    fields = [
        draw(client_ids),
        draw(st.sampled_from(ACTIONS + ["stop", "discard", "discard", "discard"])),
        draw(texts),
        draw(st.one_of(st.integers(0, 8), small_ints)),
        draw(st.one_of(st.integers(-1, 8), small_ints)),
    ]
    return [11, draw(req_ids())] + finish(draw, fields, 2)


@st.composite
def weights_fields(draw) -> list:
    spec = st.tuples(texts, st.lists(small_ints, max_size=3), st.sampled_from(["float32", "bfloat16", "", "int4"])).map(
        list
    )
    fields = [
        draw(st.sampled_from(TRANSPORTS + ["tcp"])),
        draw(texts),
        "127.0.0.1",
        draw(small_ints),
        draw(st.lists(st.lists(spec, max_size=2), max_size=2)),
        draw(small_ints),
    ]
    return finish(draw, fields, required=0)


def req_ids() -> st.SearchStrategy:
    """Mostly unique ids (matched to replies), sometimes the edges of the encodable range."""
    return st.one_of(st.integers(1, 2**40), st.integers(1, 2**40), st.integers(1, 2**40), st.sampled_from(INT_EDGES))


@st.composite
def request_array(draw, tags: tuple[int, ...] | None = None) -> list:
    """One request of any type as a raw array: ``[tag, req_id, ...fields]``."""
    tag = draw(st.sampled_from(tags or REQUEST_TAGS))
    required, build = REQUESTS[tag]
    return [tag, draw(req_ids())] + finish(draw, build(draw), required)


def encode_raw(value) -> bytes:
    return msgspec.msgpack.encode(value)


# ------------------------------------------------------------------- seeded mutations, raw frames

MARKERS = [
    0xC0,
    0xC1,
    0xC2,
    0xC3,
    0xC4,
    0xC7,
    0xCA,
    0xCB,
    0xCC,
    0xCF,
    0xD3,
    0xD4,
    0xD9,
    0xDB,
    0xDC,
    0xDD,
    0xDE,
    0xDF,
    0x90,
    0x9F,
    0x80,
    0x8F,
    0xA0,
    0xFF,
]


def mutate(buf: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """``buf`` after 1-4 random edits."""
    out = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(
            ["flip", "flip", "flip", "truncate", "extend", "insert", "delete", "marker", "marker", "splice", "dup"]
        )
        pos = rng.randrange(len(out)) if out else 0
        if op == "flip" and out:
            out[pos] ^= 1 << rng.randrange(8)
        elif op == "truncate":
            del out[pos:]
        elif op == "extend":
            out += rng.randbytes(rng.randint(1, 64))
        elif op == "insert":
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == "delete" and out:
            del out[pos : pos + rng.randint(1, 8)]
        elif op == "marker" and out:
            out[pos] = rng.choice(MARKERS)
        elif op == "splice" and others:
            other = rng.choice(others)
            out = out[:pos] + other[rng.randrange(len(other) + 1) :]
        elif op == "dup":
            out += out[pos:]
    return bytes(out)


def array_header(n: int) -> bytes:
    return bytes([0x90 + n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def raw_frame(rng: random.Random, seeds: list[bytes], tags: list[int]) -> bytes:
    """A frame that is no message: random bytes, deep nesting, or a readable header over garbage."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:  # nested past every recursion limit, alone or behind the start of a valid frame
        depth = rng.choice([64, 1000, 5000, 100_000])
        opener = rng.choice([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\x81\x00", b"\xdd\x00\x00\x00\x01"])
        prefix = rng.choice(seeds)[: rng.randint(0, 40)] if seeds and rng.random() < 0.5 else b""
        return prefix + opener * depth + b"\xc0"
    if kind == 2:  # claims of huge arrays, maps, strings and binaries with nothing behind them
        return (
            rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xdc"])
            + rng.randbytes(4)
            + rng.randbytes(rng.randint(0, 8))
        )
    if kind == 3:  # a readable [tag, req_id header, then anything: the error must carry the req_id
        return (
            array_header(rng.randint(2, 20))
            + encode_raw(rng.choice(tags))
            + encode_raw(rng.randrange(2**64))
            + rng.randbytes(rng.randint(0, 48))
        )
    if kind == 4:  # a frame of the wrong kind: reply and announcement tags, bare scalars, maps
        return encode_raw(
            rng.choice([[rng.choice([20, 21, 22, 25, 27, 40, 41]), 1, "x"], 7, "text", {"t": 1}, None, [], b"\x00"])
        )
    return array_header(rng.randint(0, 18)) + rng.randbytes(rng.randint(0, 64))


# ------------------------------------------------------------------------------ replies (client)


REPLIES = {  # tag -> (required fields after [tag, req_id], builder)
    20: (0, lambda d: [d(texts), d(small_ints), d(st.booleans())]),
    21: (2, lambda d: [d(st.sampled_from(["bad_frame", "too_large", "invalid_group", "internal", "nope"])), d(texts)]),
    22: (1, lambda d: [d(floats), d(texts)]),
    23: (
        1,
        lambda d: [
            d(texts),
            d(small_ints),
            d(small_ints),
            d(floats),
            d(weights_fields()),
            d(st.booleans()),
            d(small_ints),
            d(small_ints),
        ],
    ),
    24: (
        3,
        lambda d: [
            d(texts),
            d(
                st.lists(
                    st.tuples(texts, st.one_of(texts, st.lists(str_maps, max_size=2)), st.one_of(st.none(), texts)).map(
                        list
                    ),
                    max_size=3,
                )
            ),
            d(floats),
            d(small_ints),
        ],
    ),
    25: (3, lambda d: [d(texts), d(st.lists(group_fields(16), max_size=2)), d(floats), d(small_ints)]),
    26: (1, lambda d: [d(small_ints), d(small_ints), d(weights_fields()), d(st.booleans())]),
    27: (
        12,
        lambda d: (
            [d(texts), d(floats)]
            + [d(small_ints) for _ in range(6)]
            + [
                d(floats),
                d(floats),
                d(small_ints),
                d(small_ints),
                d(st.dictionaries(texts, small_ints, max_size=3)),
                d(st.dictionaries(texts, small_ints, max_size=3)),
                d(
                    st.lists(
                        st.tuples(
                            texts, st.sampled_from(ROLES), small_ints, small_ints, floats, st.booleans(), float_maps
                        ).map(list),
                        max_size=2,
                    )
                ),
            ]
        ),
    ),
    28: (
        1,
        lambda d: [
            d(
                st.lists(
                    st.tuples(texts, st.sampled_from(["accepted", "duplicate", "stale", "rejected", "?"]), texts).map(
                        list
                    ),
                    max_size=3,
                )
            )
        ],
    ),
}


@st.composite
def reply_array(draw) -> list:
    """One broker reply of any type as a raw array."""
    tag = draw(st.sampled_from(sorted(REPLIES)))
    required, build = REPLIES[tag]
    return [tag, draw(req_ids())] + finish(draw, build(draw), required)


@st.composite
def announcement_array(draw) -> list:
    if draw(st.booleans()):
        return [40] + finish(draw, [draw(small_ints), draw(small_ints), draw(weights_fields())], 1)
    return [41] + finish(
        draw,
        [draw(st.sampled_from(ACTIONS + ["stop", "discard", "x"])), draw(texts), draw(small_ints), draw(small_ints)],
        1,
    )


def valid_frames() -> list[bytes]:
    """Well-formed requests of every type: seeds for mutation."""
    group = m.build_group(
        "seed-g",
        "0:1",
        0,
        [1, 2, 3],
        [(np.arange(6) % 200, -np.ones(6))] * 2,
        [0.5, 1.0],
        finish_reasons=["stop", "length"],
    )
    msgs = [
        m.Register(req_id=11, client_id="fz-r0", role="rollout", info={"k": "v"}),
        m.Heartbeat(req_id=12, client_id="fz-r0", policy_version=1, stats={"tokens_per_s": 3.0}),
        m.LeasePrompts(req_id=13, client_id="fz-r0", n=2),
        m.PushGroup(req_id=14, client_id="fz-r0", group=group),
        m.PushGroups(req_id=15, client_id="fz-r0", groups=[group, group]),
        m.ReturnPrompts(req_id=16, client_id="fz-r0", lease_id="abc", prompt_ids=["0:1"]),
        m.LeaseBatch(req_id=17, client_id="fz-l0", n=4),
        m.AckBatch(req_id=18, client_id="fz-l0", lease_id="abc", step=2, group_ids=["x"], keep_rest=True),
        m.Commit(req_id=19, client_id="fz-l0", step=3),
        m.Rewind(req_id=20, client_id="fz-l0", step=3),
        m.PublishVersion(
            req_id=21,
            client_id="fz-l0",
            version=1,
            weights=m.WeightsInfo(transport="gloo", buckets=[[m.ParamSpec(name="w", shape=[2, 3], dtype="float32")]]),
        ),
        m.Control(req_id=22, client_id="fz-l0", action="pause", reason="seed"),
        m.GetStatus(req_id=23),
        m.GetVersion(req_id=24, client_id="fz-r0"),
        m.Leave(req_id=25, client_id="fz-r1", reason="seed"),
    ]
    return [m.encode(x) for x in msgs]


def valid_replies() -> list[bytes]:
    group = m.build_group("g", "0:1", 0, [1, 2, 3], [(np.arange(6), -np.ones(6))] * 2, [0.5, 1.0])
    msgs = [
        m.Ack(req_id=31, ref="g", count=1),
        m.Error(req_id=32, code="bad_frame", reason="x"),
        m.Throttle(req_id=33, retry_after_s=0.5),
        m.Registered(req_id=34, broker_id="b", pub_port=5),
        m.PromptLease(
            req_id=35, lease_id="L", prompts=[m.Prompt(prompt_id="0:1", prompt="1+1=", answer="2")], expires_in_s=3.0
        ),
        m.BatchLease(req_id=36, lease_id="B", groups=[group], expires_in_s=6.0),
        m.CurrentVersion(req_id=37, version=3),
        m.GroupAcks(req_id=38, acks=[m.GroupAck(group_id="g", status="accepted")]),
        m.VersionAnnouncement(version=2),
        m.ControlAnnouncement(action="pause"),
        m.ControlAnnouncement(action="done"),
    ]
    return [m.encode(x) for x in msgs]
