"""Protocol constants, the error codes, ``ProtocolError`` and the ``Message`` base of every frame."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

PROTOCOL_VERSION = 2
MAX_POLICY_VERSION = 2**31 - 1  # policy versions travel as int32 (token_versions); larger ones are refused at decode
MAX_ID_CHARS = 256  # client, group, prompt and lease ids: longer ones are refused at decode (issue 31: a 16 MiB id)
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
FLOAT32_MAX = 3.4028234663852886e38  # rewards and advantages are trained in float32
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
MASK_DTYPE = np.dtype("u1")

TOPIC_VERSION = b"version"
TOPIC_CONTROL = b"control"

Role = Literal["rollout", "learner", "operator", "monitor"]  # monitor: read-only (`fleetrl status`)
FinishReason = Literal["stop", "length", "abort"]
ErrorCode = Literal[
    "bad_frame",  # not a message of this protocol
    "protocol_mismatch",  # client speaks another PROTOCOL_VERSION
    "too_large",  # frame over broker.max_message_bytes
    "invalid_group",  # a SampleGroup that fails validation
    "unknown_lease",  # lease id the broker does not hold (expired and re-issued, or never existed)
    "data_exhausted",  # every epoch of the prompt set has been leased and returned
    "unauthorized",  # this key's role may not send this request, or the client_id is not this key's
    "unregistered",  # the broker holds no record of this client_id (restarted or evicted): Register again
    "unavailable",  # the broker cannot serve it now (spool disk full, client table full): retry later
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
