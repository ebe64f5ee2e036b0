"""What the broker refuses before it decodes a request: frames too large for what they are (issue 31: limits in
bytes, checked at decode).

- any frame over ``broker.max_message_bytes``;
- a request other than a push over ``SMALL_FRAME`` bytes, and a ``Register`` or ``Heartbeat`` over
  4 x ``broker.max_client_info_bytes`` + 4 KiB (their info and stats are bounded after decoding; the
  decode itself of a 64 MiB dict would cost several times that);
- a ``PushGroups`` of more than ``broker.max_groups_per_push`` groups (read from its header);
- a pushed group whose *side* fields (metadata, reward_parts, failed_parts, trace and the per-response
  lists: what becomes Python objects, ~9 x its wire size for lists of small integers) weigh more than
  ``broker.max_group_metadata_bytes``, or a frame whose groups' side fields weigh more than
  ``FRAME_SIDE`` x that together. Measured by ``messages.push_sizes``: every field skipped as raw bytes,
  nothing materialized (skipping 48 Mi small integers still takes 0.1-0.2 s, so a PushGroup whose first fields
  already show it ``FAST`` x over the budget is refused from them: :func:`side_at_least`).

A frame no larger than ``broker.max_group_metadata_bytes`` is not measured (its groups' side fields cannot
weigh more), so an ordinary push costs nothing here. After decoding, a push frame that holds much more than
its groups' arrays (large side fields, or fields a newer or hostile sender appended, which decoding skips)
has its groups copied out of it (:func:`detach_if_pinning`), so a held group never pins a larger frame.
"""

from __future__ import annotations

from fleetrl.common import messages as m
from fleetrl.common.config.schema import BrokerConfig

SMALL_FRAME = 16 << 20  # requests other than pushes: ack lists, weight specs
FRAME_SIDE = 8  # a push frame's groups together: at most this many x broker.max_group_metadata_bytes of side fields
INFO_TAGS = (m.Register.__struct_config__.tag, m.Heartbeat.__struct_config__.tag)

FAST = 16  # a PushGroup whose first fields show it FAST x over broker.max_group_metadata_bytes is refused at once
Refusal = tuple[str, m.Error]  # (the Status.rejected key, the reply)


def precheck(payload: memoryview, header: tuple[int, int] | None, req_id: int, bcfg: BrokerConfig) -> Refusal | None:
    """Why a frame is refused before decoding (the Status.rejected key and the reply), or None."""
    if len(payload) > bcfg.max_message_bytes:
        return (
            "too_large",
            m.Error(
                req_id=req_id,
                code="too_large",
                reason=(
                    f"frame of {len(payload)} bytes is over broker.max_message_bytes={bcfg.max_message_bytes}; "
                    "send smaller groups or raise that setting"
                ),
            ),
        )
    tag = header[0] if header else None
    if tag not in m.PUSH_GROUP_TAGS:
        limit = 4 * bcfg.max_client_info_bytes + 4096 if tag in INFO_TAGS else SMALL_FRAME
        if len(payload) > limit:
            return (
                "too_large",
                m.Error(
                    req_id=req_id,
                    code="too_large",
                    reason=(
                        f"a {len(payload)}-byte request (tag {tag}) is over the {limit} bytes such a request may take "
                        "(Register/Heartbeat: 4 x broker.max_client_info_bytes + 4096)"
                    ),
                ),
            )
        return None
    if tag == m.PushGroups.__struct_config__.tag:
        count = m.peek_push_count(payload)
        if count is not None and count > bcfg.max_groups_per_push:
            return (
                "too_many_groups",
                m.Error(
                    req_id=req_id,
                    code="too_large",
                    reason=(
                        f"{count} groups in one PushGroups, over broker.max_groups_per_push={bcfg.max_groups_per_push}; "
                        "push them in several frames"
                    ),
                ),
            )
    if len(payload) <= bcfg.max_group_metadata_bytes:
        return None  # its groups' side fields cannot weigh more than the frame: nothing to measure
    if tag == m.PushGroup.__struct_config__.tag:
        least = side_at_least(payload)
        if least is not None and least > FAST * bcfg.max_group_metadata_bytes:  # refused from its first fields: O(1)
            return (
                "too_large",
                m.Error(
                    req_id=req_id,
                    code="too_large",
                    reason=(
                        f"a group with at least {least} bytes of metadata, reward_parts, failed_parts, trace and per-response "
                        f"lists, over broker.max_group_metadata_bytes={bcfg.max_group_metadata_bytes}; send less metadata, "
                        "or raise that setting"
                    ),
                ),
            )
    return side_check(payload, req_id, bcfg.max_group_metadata_bytes)


def side_at_least(buf: memoryview) -> int | None:
    """About the least a PushGroup's side fields can weigh, read from its first fields only: everything after its
    log-probs but what arrays there may take (loss mask and token versions: 5 bytes a token; 64 x the prompt, for
    per-sample fields a newer sender may append). None when the frame is laid out otherwise. Used only to refuse
    at once what is FAST x over the budget (a 48 MiB metadata frame: no skipping 48 Mi items, 0.1-0.2 s)."""
    try:
        kind, n, off = _head(buf, 0)
        if kind != "array" or n < 4:
            return None
        for want in ("int", "int", "str"):  # tag, req_id, client_id
            kind, n, off = _head(buf, off)
            if kind != want:
                return None
            off += n if kind == "str" else 0
        kind, n, off = _head(buf, off)  # the group
        if kind != "array" or n < 7:
            return None
        bins = []
        for want in ("str", "str", "int", "bin", "array", "bin", "bin"):  # group_id ... logprobs
            kind, n, off = _head(buf, off)
            if kind != want:
                return None
            if kind == "array":  # lengths: small ints
                if n > 1 << 16:
                    return None
                for _ in range(n):
                    kind, _, off = _head(buf, off)
                    if kind != "int":
                        return None
            elif kind != "int":
                off += n
                if kind == "bin":
                    bins.append(n)
        prompt, logprobs = bins[0], bins[-1]  # 4 bytes a token each
        return len(buf) - off - (5 * logprobs) // 4 - 64 * prompt - (64 << 10)
    except (IndexError, TypeError):
        return None


def _head(buf: memoryview, off: int) -> tuple[str, int, int]:
    """(kind, count or byte length, offset after the header) of the msgpack value at ``off``; ints are skipped."""
    b = buf[off]
    if b <= 0x7F or b >= 0xE0:
        return "int", 0, off + 1
    if 0x90 <= b <= 0x9F:
        return "array", b & 0x0F, off + 1
    if 0xA0 <= b <= 0xBF:
        return "str", b & 0x1F, off + 1
    if 0xCC <= b <= 0xD3:
        return "int", 0, off + 1 + (1 << ((b - 0xCC) & 3))
    for first, kind in ((0xC4, "bin"), (0xD9, "str")):
        if first <= b <= first + 2:
            size = 1 << (b - first)
            return kind, int.from_bytes(buf[off + 1 : off + 1 + size], "big"), off + 1 + size
    if b in (0xDC, 0xDD):
        size = 2 if b == 0xDC else 4
        return "array", int.from_bytes(buf[off + 1 : off + 1 + size], "big"), off + 1 + size
    return "other", 0, off + 1


def side_check(payload: memoryview, req_id: int, limit: int) -> Refusal | None:
    """Each pushed group's side fields within ``limit`` (FRAME_SIDE x it together), read as raw spans."""
    sizes = m.push_sizes(payload)
    if sizes is None:
        return None  # the full decode says what is wrong with it
    side = [s for _, s in sizes]
    worst = max(side, default=0)
    if worst > limit or sum(side) > FRAME_SIDE * limit:
        what = (
            f"a group with {worst} bytes of metadata, reward_parts, failed_parts, trace and per-response lists"
            if worst > limit
            else f"groups with {sum(side)} bytes of those fields together (at most {FRAME_SIDE} x it)"
        )
        return (
            "too_large",
            m.Error(
                req_id=req_id,
                code="too_large",
                reason=(
                    f"{what}, over broker.max_group_metadata_bytes={limit}; send less metadata, or raise that setting"
                ),
            ),
        )
    return None


def detach_if_pinning(req: m.PushGroup | m.PushGroups, frame_bytes: int) -> None:
    """Copy the groups' arrays out of a frame that holds much besides them (more than twice their arrays + 64 KiB),
    so that a held group does not pin it."""
    groups = [req.group] if isinstance(req, m.PushGroup) else req.groups
    if frame_bytes <= 2 * sum(m.arrays_nbytes(g) for g in groups) + (64 << 10):
        return
    if isinstance(req, m.PushGroup):
        req.group = m.detached(req.group)
    else:
        req.groups = [m.detached(g) for g in req.groups]
