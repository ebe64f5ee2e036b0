"""What a group costs in bytes, read before it is decoded (issue 31: limits count bytes, not items).

A group's token arrays arrive as raw bytes and are held as views into the frame, so they cost what
they weigh on the wire. Its other fields do not: metadata, reward_parts, failed_parts, trace and the
per-response lists (lengths, rewards, finish_reasons, failed) become Python objects, and a msgpack list
of small integers takes ~9 times its wire size once decoded (a 48 MiB metadata list took 430 MB).
These are the group's *side* fields. :func:`push_sizes` measures them in a push frame without
decoding them (msgspec skips each field as raw bytes, in C), so the broker refuses an oversized group
before it costs anything; :func:`group_nbytes` is what the broker counts for a group it holds.
"""

from __future__ import annotations

import msgspec

from fleetrl.common.messages.groups import SampleGroup
from fleetrl.common.messages.protocol import PushGroup, PushGroups

ARRAYS = ("prompt_tokens", "tokens", "logprobs", "loss_mask", "token_versions")  # raw bytes: held as frame views
SIDE = ("lengths", "rewards", "finish_reasons", "reward_parts", "failed", "trace", "metadata", "failed_parts")
SIDE_WEIGHT = 8  # what one wire byte of side fields costs decoded (lists of small ints: ~9x), in held-bytes budgets
GROUP_OVERHEAD = 512  # the struct, its ids and small fields

# Every field of SampleGroup as raw msgpack (fields appended by a newer sender are skipped).
GroupShape = msgspec.defstruct(
    "GroupShape", [(f, msgspec.Raw, msgspec.Raw()) for f in SampleGroup.__struct_fields__], array_like=True
)


class PushGroupShape(msgspec.Struct, array_like=True, tag=PushGroup.__struct_config__.tag, tag_field="t"):
    req_id: msgspec.Raw
    client_id: msgspec.Raw
    group: GroupShape  # type: ignore[valid-type]


class PushGroupsShape(msgspec.Struct, array_like=True, tag=PushGroups.__struct_config__.tag, tag_field="t"):
    req_id: msgspec.Raw
    client_id: msgspec.Raw
    groups: list[GroupShape]  # type: ignore[valid-type]


_shape_decoder = msgspec.msgpack.Decoder(PushGroupShape | PushGroupsShape)


def push_sizes(buf: bytes | memoryview) -> list[tuple[int, int]] | None:
    """(array bytes, side bytes) of each group of a PushGroup / PushGroups frame, read without decoding
    any field; None when the frame is not laid out like one (the full decode then says what is wrong)."""
    try:
        shape = _shape_decoder.decode(buf)
    except (msgspec.MsgspecError, RecursionError):
        return None
    groups = [shape.group] if isinstance(shape, PushGroupShape) else shape.groups
    return [(sum(len(getattr(g, f)) for f in ARRAYS), sum(len(getattr(g, f)) for f in SIDE)) for g in groups]


_encoder = msgspec.msgpack.Encoder()


def side_bytes(g: SampleGroup) -> int:
    """The msgpack size of a decoded group's side fields (its per-response lists estimated at 24 bytes a
    response; metadata, reward_parts, trace and failed_parts encoded, when present)."""
    n = 24 * len(g.lengths)
    if g.metadata or g.reward_parts or g.trace or g.failed_parts:
        n += len(_encoder.encode((g.metadata, g.reward_parts, g.trace, g.failed_parts)))
    return n


def group_nbytes(g: SampleGroup) -> int:
    """Bytes a held group counts against ``broker.max_held_bytes``: its arrays as they weigh, its side fields
    ``SIDE_WEIGHT`` times their wire size (what they take decoded), and a fixed overhead."""
    return arrays_nbytes(g) + SIDE_WEIGHT * side_bytes(g) + GROUP_OVERHEAD


def detached(g: SampleGroup) -> SampleGroup:
    """``g`` with its arrays copied out of the frame they were decoded from: a held group then pins only its
    own bytes, not a frame of many refused siblings (or of bytes a sender appended)."""
    return msgspec.structs.replace(g, **{f: bytes(getattr(g, f)) for f in ARRAYS if len(getattr(g, f))})


def arrays_nbytes(g: SampleGroup) -> int:
    return len(g.prompt_tokens) + len(g.tokens) + len(g.logprobs) + len(g.loss_mask) + len(g.token_versions)
