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
  nothing materialized.

A push frame that holds much more than its groups account for (fields a newer or hostile sender appended,
which decoding skips) has its groups copied out of it (:func:`detach_groups`), so a held group never pins
a frame larger than itself.
"""

from __future__ import annotations

from fleetrl.common import messages as m
from fleetrl.common.config.schema import BrokerConfig

SMALL_FRAME = 16 << 20  # requests other than pushes: ack lists, weight specs
FRAME_SIDE = 8  # a push frame's groups together: at most this many x broker.max_group_metadata_bytes of side fields
INFO_TAGS = (m.Register.__struct_config__.tag, m.Heartbeat.__struct_config__.tag)
NO_LIMIT = 1 << 62
UNMEASURED = 64 << 10  # push frames up to this size are not measured

Refusal = tuple[str, m.Error]  # (the Status.rejected key, the reply)


def precheck(payload: memoryview, header: tuple[int, int] | None, req_id: int,
             bcfg: BrokerConfig) -> tuple[Refusal | None, int]:
    """(refusal or None, the frame size beyond which a push's groups are copied out of their frame)."""
    if len(payload) > bcfg.max_message_bytes:
        return ("too_large", m.Error(req_id=req_id, code="too_large", reason=(
            f"frame of {len(payload)} bytes is over broker.max_message_bytes={bcfg.max_message_bytes}; "
            "send smaller groups or raise that setting"))), NO_LIMIT
    tag = header[0] if header else None
    if tag not in m.PUSH_GROUP_TAGS:
        limit = 4 * bcfg.max_client_info_bytes + 4096 if tag in INFO_TAGS else SMALL_FRAME
        if len(payload) > limit:
            return ("too_large", m.Error(req_id=req_id, code="too_large", reason=(
                f"a {len(payload)}-byte request (tag {tag}) is over the {limit} bytes such a request may take "
                "(Register/Heartbeat: 4 x broker.max_client_info_bytes + 4096)"))), NO_LIMIT
        return None, NO_LIMIT
    if tag == m.PushGroups.__struct_config__.tag:
        count = m.peek_push_count(payload)
        if count is not None and count > bcfg.max_groups_per_push:
            return ("too_many_groups", m.Error(req_id=req_id, code="too_large", reason=(
                f"{count} groups in one PushGroups, over broker.max_groups_per_push={bcfg.max_groups_per_push}; "
                "push them in several frames"))), NO_LIMIT
    if len(payload) <= min(UNMEASURED, bcfg.max_group_metadata_bytes):
        return None, NO_LIMIT  # no side fields over the limit, and a frame too small to matter if a group pins it
    return side_check(payload, req_id, bcfg.max_group_metadata_bytes)


def side_check(payload: memoryview, req_id: int, limit: int) -> tuple[Refusal | None, int]:
    """Each pushed group's side fields within ``limit`` (FRAME_SIDE x it together), read as raw spans."""
    sizes = m.push_sizes(payload)
    if sizes is None:
        return None, NO_LIMIT  # the full decode says what is wrong with it
    side = [s for _, s in sizes]
    worst = max(side, default=0)
    if worst > limit or sum(side) > FRAME_SIDE * limit:
        what = (f"a group with {worst} bytes of metadata, reward_parts, failed_parts, trace and per-response lists"
                if worst > limit else f"groups with {sum(side)} bytes of those fields together (at most {FRAME_SIDE} x it)")
        return ("too_large", m.Error(req_id=req_id, code="too_large", reason=(
            f"{what}, over broker.max_group_metadata_bytes={limit}; send less metadata, or raise that setting"))), NO_LIMIT
    return None, 2 * sum(a + s for a, s in sizes) + (64 << 10)


def detach_groups(req: m.PushGroup | m.PushGroups) -> None:
    """Copy the groups' arrays out of a frame that holds much besides them, so that a held group does not pin it."""
    if isinstance(req, m.PushGroup):
        req.group = m.detached(req.group)
    else:
        req.groups = [m.detached(g) for g in req.groups]
