"""Every message between rollout servers, the broker and learners.

Frames are msgpack arrays (``array_like=True``): ``[tag, field, field, ...]``. Token ids travel as raw
little-endian ``int32`` bytes and log-probs as little-endian ``float32`` bytes (``TOKEN_DTYPE``,
``LOGPROB_DTYPE``); their length is the response length. That keeps a group of 8 x 512 tokens at
~33 KB and ~5 µs to encode and decode, against ~300 µs as msgpack lists.

Decoding goes through :func:`decode_request`, :func:`decode_reply` and :func:`decode_announcement`,
which raise :class:`ProtocolError` (and nothing else) with a readable reason for random bytes,
truncated frames, wrong types, arrays whose lengths disagree and non-finite rewards.

Requests carry a client-chosen ``req_id``; the broker's reply carries the same ``req_id`` so that one
DEALER socket can have many requests in flight.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 1
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")

TOPIC_VERSION = b"version"
TOPIC_CONTROL = b"control"

Role = Literal["rollout", "learner", "monitor"]
FinishReason = Literal["stop", "length", "abort"]
ErrorCode = Literal[
    "bad_frame",  # not a message of this protocol
    "protocol_mismatch",  # client speaks another PROTOCOL_VERSION
    "too_large",  # frame over broker.max_message_bytes
    "invalid_group",  # a SampleGroup that fails validation
    "unknown_lease",  # lease id the broker does not hold (expired and re-issued, or never existed)
    "data_exhausted",  # every epoch of the prompt set has been leased and returned
    "unauthorized",  # not allowed for this client
    "bad_request",  # well-formed but not acceptable (e.g. n <= 0)
    "internal",  # a broker bug; the request changed nothing
]


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``reason`` says what was wrong with it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Message(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag_field="t"):
    """Base of every wire message (tagged by a small integer)."""


# ------------------------------------------------------------------------------- payloads


class Prompt(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One prompt of the data set. ``prompt_id`` is stable across re-issues ("<epoch>:<index>")."""

    prompt_id: str
    prompt: Union[str, list[dict[str, str]]]  # raw text, or chat messages [{role, content}]
    answer: Union[str, None] = None
    metadata: dict[str, Any] = {}


class SampleGroup(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """All responses to one prompt, produced by one policy version: a ragged batch.

    The responses' token ids and behaviour log-probs lie back to back in two flat arrays; response
    ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` with ``offsets = cumsum([0] + lengths)``. Decoded
    arrays are memoryviews into the frame they arrived in (no copy); use :meth:`token_array`,
    :meth:`logprob_array` and :meth:`response_tokens` to read them.
    """

    group_id: str  # unique per group; a retried push keeps it, so the broker de-duplicates
    prompt_id: str
    policy_version: int
    prompt_tokens: memoryview  # int32 LE [P]
    lengths: list[int]  # [G] response lengths in tokens
    tokens: memoryview  # int32 LE [sum(lengths)]: sampled token ids
    logprobs: memoryview  # float32 LE [sum(lengths)]: log mu(token | prefix) from the engine's raw logits
    rewards: list[float]  # [G]
    finish_reasons: list[FinishReason] = []  # [G]; empty = every response ended with "stop"
    reward_parts: list[dict[str, float]] = []  # [G] per reward function, for logging
    failed: list[bool] = []  # [G] a reward function failed on this sample
    lease_id: str = ""
    server_id: str = ""
    trace: dict[str, str] = {}  # W3C trace context (traceparent, tracestate)
    created_at: float = 0.0
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        gid, n = self.group_id, len(self.lengths)
        if not gid:
            raise ValueError("group has an empty group_id")
        if n == 0:
            raise ValueError(f"group {gid} has no responses; push groups of at least one response")
        if len(self.rewards) != n:
            raise ValueError(f"group {gid} has {n} responses but {len(self.rewards)} rewards; send one reward per response")
        for name in ("finish_reasons", "reward_parts", "failed"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"group {gid} has {n} responses but {len(getattr(self, name))} {name}")
        if min(self.lengths) < 0:
            raise ValueError(f"group {gid} has a negative response length")
        total = 4 * sum(self.lengths)
        if len(self.tokens) != total:
            raise ValueError(f"group {gid} lengths sum to {total // 4} tokens but tokens holds {len(self.tokens)} bytes "
                             f"({len(self.tokens) / 4:g} int32)")
        if len(self.logprobs) != total:
            raise ValueError(f"group {gid} has {total // 4} tokens but {len(self.logprobs) / 4:g} log-probs; "
                             "send one behaviour log-prob per sampled token")
        if not all(map(math.isfinite, self.rewards)):
            raise ValueError(f"group {gid} has a reward that is not finite ({self.rewards}); rewards must be finite numbers")
        if not len(self.prompt_tokens) or len(self.prompt_tokens) % 4:
            raise ValueError(f"group {gid} prompt_tokens is {len(self.prompt_tokens)} bytes, not int32 ids")
        if self.policy_version < 0:
            raise ValueError(f"group {gid} has negative policy_version {self.policy_version}")

    @property
    def num_responses(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def offsets(self) -> np.ndarray:
        """[G + 1] start of each response in the flat arrays, then the total."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def prompt_array(self) -> np.ndarray:
        return np.frombuffer(self.prompt_tokens, dtype=TOKEN_DTYPE)

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype=LOGPROB_DTYPE)

    def response_tokens(self, i: int) -> np.ndarray:
        start = sum(self.lengths[:i])
        return self.token_array()[start : start + self.lengths[i]]

    def finish_reason(self, i: int) -> str:
        return self.finish_reasons[i] if self.finish_reasons else "stop"


def build_group(group_id: str, prompt_id: str, policy_version: int, prompt_ids: Any, responses: list[tuple[Any, Any]],
                rewards: list[float], finish_reasons: list[str] | None = None, **fields: Any) -> SampleGroup:
    """A SampleGroup from per-response (token ids, log-probs) pairs (lists or arrays)."""
    tokens = [np.asarray(t, dtype=TOKEN_DTYPE) for t, _ in responses]
    logprobs = [np.asarray(lp, dtype=LOGPROB_DTYPE) for _, lp in responses]
    return SampleGroup(
        group_id=group_id, prompt_id=prompt_id, policy_version=policy_version,
        prompt_tokens=np.asarray(prompt_ids, dtype=TOKEN_DTYPE).tobytes(), lengths=[len(t) for t in tokens],
        tokens=b"".join(t.tobytes() for t in tokens), logprobs=b"".join(lp.tobytes() for lp in logprobs),
        rewards=[float(r) for r in rewards], finish_reasons=list(finish_reasons or []), **fields,
    )


class ParamSpec(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    name: str
    shape: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


class WeightsInfo(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What a rollout server needs to fetch one weight version."""

    transport: Literal["filesystem", "gloo", "nccl", "none"] = "none"
    path: str = ""  # filesystem: directory with model.safetensors
    master_addr: str = ""  # broadcast: TCPStore host of learner rank 0
    master_port: int = 0
    buckets: list[list[ParamSpec]] = []  # broadcast: parameters of each flat bucket, in order
    round_id: int = 0  # broadcast: which round of the group to join
    published_at: float = 0.0  # learner wall clock at publishing: orders versions across resumes and rollbacks


class ClientInfo(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    client_id: str
    role: str
    rank: int = 0
    policy_version: int = 0
    last_seen_s: float = 0.0  # seconds since the last request
    alive: bool = True
    stats: dict[str, float] = {}


# ---------------------------------------------------------------- requests (client -> broker)


class Register(Message, tag=1):  # Rollout/Learner -> Broker
    req_id: int
    client_id: str
    role: Role
    protocol: int = PROTOCOL_VERSION
    rank: int = 0
    info: dict[str, str] = {}


class Heartbeat(Message, tag=2):  # Rollout/Learner -> Broker
    req_id: int
    client_id: str
    policy_version: int = 0
    stats: dict[str, float] = {}


class LeasePrompts(Message, tag=3):  # Rollout -> Broker
    req_id: int
    client_id: str
    n: int
    policy_version: int = 0


class PushGroup(Message, tag=4):  # Rollout -> Broker
    req_id: int
    client_id: str
    group: SampleGroup


class PushGroups(Message, tag=14):  # Rollout -> Broker: several groups in one frame (one ack each)
    req_id: int
    client_id: str
    groups: list[SampleGroup]


class ReturnPrompts(Message, tag=5):  # Rollout -> Broker (shutdown: give leased prompts back)
    req_id: int
    client_id: str
    lease_id: str
    prompt_ids: list[str] = []  # empty = every prompt of the lease still open


class LeaseBatch(Message, tag=6):  # Learner -> Broker
    req_id: int
    client_id: str
    n: int  # groups wanted
    wait_s: float = 0.0  # hold the request up to this long for groups to arrive
    min_groups: int = 1  # reply once this many are ready (or at wait_s with what is there)


class AckBatch(Message, tag=7):  # Learner -> Broker (trained on the lease)
    req_id: int
    client_id: str
    lease_id: str
    step: int = 0
    group_ids: list[str] = []  # the groups done with; empty = all
    keep_rest: bool = False  # False: the lease closes and groups not listed are requeued; True: they stay leased


class Commit(Message, tag=8):  # Learner -> Broker (a checkpoint covers every ack up to `step`)
    req_id: int
    client_id: str
    step: int


class Rewind(Message, tag=9):  # Learner -> Broker (resumed at `step`: requeue uncommitted later acks)
    req_id: int
    client_id: str
    step: int


class PublishVersion(Message, tag=10):  # Learner rank 0 -> Broker
    req_id: int
    client_id: str
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)


class Control(Message, tag=11):  # Learner/operator -> Broker
    req_id: int
    client_id: str
    action: Literal["pause", "resume", "stop", "discard"]
    reason: str = ""
    min_version: int = 0  # discard: drop queued groups older than this version
    max_version: int = -1  # discard: and newer than this one (-1 = no upper bound)


class GetStatus(Message, tag=12):  # anyone -> Broker
    req_id: int
    client_id: str = ""


class GetVersion(Message, tag=13):  # Rollout -> Broker (late subscriber catches up)
    req_id: int
    client_id: str = ""


Request = Union[
    Register, Heartbeat, LeasePrompts, PushGroup, PushGroups, ReturnPrompts, LeaseBatch, AckBatch, Commit, Rewind,
    PublishVersion, Control, GetStatus, GetVersion,
]


# ----------------------------------------------------------------- replies (broker -> client)


class Ack(Message, tag=20):  # Broker -> client
    req_id: int
    ref: str = ""  # what was acknowledged (group id, lease id)
    count: int = 0
    duplicate: bool = False  # the group was already held: acked again, enqueued once


class GroupAck(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    group_id: str
    status: Literal["accepted", "duplicate", "stale", "rejected"]
    reason: str = ""


class GroupAcks(Message, tag=28):  # Broker -> Rollout: the fate of each group of a PushGroups
    req_id: int
    acks: list[GroupAck]


class Error(Message, tag=21):  # Broker -> client
    req_id: int
    code: ErrorCode
    reason: str


class Throttle(Message, tag=22):  # Broker -> client: come back later
    req_id: int
    retry_after_s: float
    reason: str = ""


class Registered(Message, tag=23):  # Broker -> client
    req_id: int
    broker_id: str
    policy_version: int = 0
    vocab_size: int = 0  # 0 = unknown
    heartbeat_s: float = 2.0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)
    paused: bool = False
    pub_port: int = 0  # announcements: SUB-connect to the broker's host on this port
    max_message_bytes: int = 0  # larger frames are refused; clients check before sending


class PromptLease(Message, tag=24):  # Broker -> Rollout
    req_id: int
    lease_id: str
    prompts: list[Prompt]
    expires_in_s: float
    policy_version: int = 0


class BatchLease(Message, tag=25):  # Broker -> Learner
    req_id: int
    lease_id: str
    groups: list[SampleGroup]
    expires_in_s: float
    dropped_stale: int = 0  # groups dropped as too stale while filling this lease


class CurrentVersion(Message, tag=26):  # Broker -> client
    req_id: int
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)
    paused: bool = False


class Status(Message, tag=27):  # Broker -> anyone
    req_id: int
    broker_id: str
    uptime_s: float
    policy_version: int
    queue_depth: int
    groups_in_flight: int  # leased to learners, not yet acked
    prompts_leased: int  # leased to rollouts, not yet returned as groups
    groups_in: int
    groups_out: int
    groups_in_per_s: float
    groups_out_per_s: float
    dropped_stale: int
    duplicates: int
    rejected: dict[str, int] = {}
    staleness_hist: dict[str, int] = {}  # policy lag of handed-out groups -> count
    clients: list[ClientInfo] = []
    paused: bool = False
    data_epoch: int = 0
    data_cursor: int = 0
    throttled: int = 0
    uncommitted: int = 0


Reply = Union[Ack, Error, Throttle, Registered, PromptLease, BatchLease, CurrentVersion, Status, GroupAcks]


# ------------------------------------------------------------ announcements (broker PUB)


class VersionAnnouncement(Message, tag=40):  # Broker -> all (topic "version")
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)


class ControlAnnouncement(Message, tag=41):  # Broker -> all (topic "control")
    action: Literal["pause", "resume", "stop", "discard"]
    reason: str = ""
    min_version: int = 0
    max_version: int = -1


Announcement = Union[VersionAnnouncement, ControlAnnouncement]


# --------------------------------------------------------------------------- encode/decode

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_announcement_decoder = msgspec.msgpack.Decoder(Announcement)
_group_decoder = msgspec.msgpack.Decoder(SampleGroup)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, buf: bytes, what: str) -> Any:
    try:
        return decoder.decode(buf)
    except msgspec.ValidationError as e:
        text = str(e)
        if text.startswith("Invalid value") and text.endswith("at `$[0]`"):
            text = f"unknown message tag {text.split()[2]} (not a {what} of protocol v{PROTOCOL_VERSION})"
        raise ProtocolError(f"invalid {what}: {text}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable {what} ({len(buf)} bytes): {e}") from None
    except Exception as e:  # noqa: BLE001 - the boundary promises ProtocolError and nothing else
        raise ProtocolError(f"undecodable {what} ({len(buf)} bytes): {type(e).__name__}: {e}") from None


def decode_request(buf: bytes) -> Request:
    """Decode a client request; raises ProtocolError on anything that is not one."""
    return _decode(_request_decoder, buf, "request")


def decode_reply(buf: bytes) -> Reply:
    """Decode a broker reply; raises ProtocolError on anything that is not one."""
    return _decode(_reply_decoder, buf, "reply")


def decode_announcement(buf: bytes) -> Announcement:
    """Decode a PUB announcement payload; raises ProtocolError on anything that is not one."""
    return _decode(_announcement_decoder, buf, "announcement")


def decode_group(buf: bytes) -> SampleGroup:
    """Decode one bare SampleGroup (spool records); raises ProtocolError."""
    return _decode(_group_decoder, buf, "sample group")


def peek_header(buf: bytes) -> tuple[int, int] | None:
    """(tag, req_id) read from the first bytes of a frame without decoding the rest, or None.

    Lets the broker answer an oversized or invalid frame with a typed error the client can match.
    """
    try:
        off = 1 if 0x90 <= buf[0] <= 0x9F else 3 if buf[0] == 0xDC else 5 if buf[0] == 0xDD else 0
        if not off:
            return None
        values = []
        for _ in range(2):
            b = buf[off]
            if b < 0x80:
                values.append(b)
                off += 1
            elif 0xCC <= b <= 0xCF:
                size = 1 << (b - 0xCC)
                values.append(int.from_bytes(buf[off + 1 : off + 1 + size], "big"))
                off += 1 + size
            else:
                return None
        return values[0], values[1]
    except IndexError:
        return None


def to_dict(value: Any) -> Any:
    """A message as plain dicts/lists (``to_builtins`` would give arrays for array-like structs)."""
    if isinstance(value, msgspec.Struct):
        return {f: to_dict(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, (list, tuple)):
        return [to_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: to_dict(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return value


PUSH_GROUP_TAGS = (PushGroup.__struct_config__.tag, PushGroups.__struct_config__.tag)


# ---------------------------------------------------------------------------- array helpers


def pack_tokens(ids: Any) -> bytes:
    """Token ids (list or array) -> int32 little-endian bytes."""
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def unpack_tokens(buf: bytes) -> np.ndarray:
    """int32 little-endian bytes -> read-only int32 array [T]."""
    return np.frombuffer(buf, dtype=TOKEN_DTYPE)


def pack_logprobs(values: Any) -> bytes:
    """Log-probs (list or array) -> float32 little-endian bytes."""
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def unpack_logprobs(buf: bytes) -> np.ndarray:
    """float32 little-endian bytes -> read-only float32 array [T]."""
    return np.frombuffer(buf, dtype=LOGPROB_DTYPE)


def check_group(group: SampleGroup, vocab_size: int = 0) -> str | None:
    """Deeper checks than decoding does (token range, finite log-probs); returns a reason or None.

    Decoding already guarantees matching lengths, finite rewards and a non-empty group. Three
    reductions over zero-copy views: ids read as *unsigned* so that a negative id shows up as huge,
    and the sum of the log-probs, which is finite only if every one of them is.
    """
    hi = max(int(np.frombuffer(group.prompt_tokens, dtype="<u4").max()),
             int(np.frombuffer(group.tokens, dtype="<u4").max()) if len(group.tokens) else 0)
    if hi >= 2**31:
        return f"group {group.group_id} has a negative token id {hi - 2**32}"
    if vocab_size and hi >= vocab_size:
        return f"group {group.group_id} has token id {hi} outside the vocabulary of {vocab_size}"
    if len(group.logprobs) and not np.isfinite(np.frombuffer(group.logprobs, dtype=LOGPROB_DTYPE).sum(dtype=np.float64)):
        return f"group {group.group_id} has log-probs that are not finite"
    return None
