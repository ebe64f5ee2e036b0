"""Encoding and the typed decoders: a bad frame fails here, at the boundary, with ``ProtocolError``."""

from __future__ import annotations

from typing import Any

import msgspec

from fleetrl.common.messages.base import MAX_ID_CHARS, PROTOCOL_VERSION, ProtocolError
from fleetrl.common.messages.groups import SampleGroup
from fleetrl.common.messages.protocol import Announcement, Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_announcement_decoder = msgspec.msgpack.Decoder(Announcement)
_group_decoder = msgspec.msgpack.Decoder(SampleGroup)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def encode_raw(obj: Any) -> msgspec.Raw:
    """``obj`` encoded once, to sit inside later messages as it is (a push's groups, re-sent on every retry
    with only the small envelope encoded again): ``encode(PushGroups(..., groups=encode_raw(groups)))`` is the
    same frame as with the groups themselves."""
    return msgspec.Raw(_encoder.encode(obj))


def _decode(decoder: msgspec.msgpack.Decoder, buf: bytes | memoryview, what: str) -> Any:
    try:
        return decoder.decode(buf)
    except msgspec.ValidationError as e:
        text = str(e)
        if text.startswith("Invalid value") and text.endswith("at `$[0]`"):
            text = f"unknown message tag {text.split()[2]} (not a {what} of protocol v{PROTOCOL_VERSION})"
        elif f"length <= {MAX_ID_CHARS}" in text:
            text += f" (client, group, prompt and lease ids are at most {MAX_ID_CHARS} characters)"
        raise ProtocolError(f"invalid {what}: {text}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable {what} ({len(buf)} bytes): {e}") from None
    except Exception as e:  # noqa: BLE001 - the boundary promises ProtocolError and nothing else
        raise ProtocolError(f"undecodable {what} ({len(buf)} bytes): {type(e).__name__}: {e}") from None


def decode_request(buf: bytes | memoryview) -> Request:
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


def peek_header(buf: bytes | memoryview) -> tuple[int, int] | None:
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


def _skip_str(buf: bytes | memoryview, off: int) -> int | None:
    b = buf[off]
    if 0xA0 <= b <= 0xBF:
        return off + 1 + (b & 0x1F)
    if b in (0xD9, 0xDA, 0xDB):
        size = 1 << (b - 0xD9)
        return off + 1 + size + int.from_bytes(buf[off + 1 : off + 1 + size], "big")
    return None


def peek_push_count(buf: bytes | memoryview) -> int | None:
    """The number of groups a PushGroups frame ``[tag, req_id, client_id, [groups...]]`` claims, read from its
    first bytes without decoding it (None when the frame is not laid out like one). Lets the broker refuse
    a frame of a million groups before it decodes them."""
    try:
        off = 1 if 0x90 <= buf[0] <= 0x9F else 3 if buf[0] == 0xDC else 5 if buf[0] == 0xDD else 0
        if not off:
            return None
        for _ in range(2):  # tag, req_id: positive ints
            b = buf[off]
            off += 1 if b < 0x80 else 1 + (1 << (b - 0xCC)) if 0xCC <= b <= 0xCF else -off
            if off <= 0:
                return None
        after = _skip_str(buf, off)
        if after is None:
            return None
        off = after
        b = buf[off]
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b in (0xDC, 0xDD):
            size = 2 if b == 0xDC else 4
            return int.from_bytes(buf[off + 1 : off + 1 + size], "big")
        return None
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
