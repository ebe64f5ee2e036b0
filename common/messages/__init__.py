"""Every message between rollout servers, the broker and learners (``from fleetrl.common import messages as m``).

One package, one namespace: ``base`` (constants, error codes, the ``Message`` base), ``groups`` (the
``Prompt`` and ``SampleGroup`` payloads), ``weights`` (weight-sync specs and the TCPStore round
records), ``protocol`` (requests, replies, announcements) and ``codec`` (encode, typed decoders).


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

from fleetrl.common.messages.base import (  # noqa: F401
    FLOAT32_MAX,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    MAX_ID_CHARS,
    MAX_POLICY_VERSION,
    PROTOCOL_VERSION,
    TOKEN_DTYPE,
    TOPIC_CONTROL,
    TOPIC_VERSION,
    ErrorCode,
    FinishReason,
    Message,
    ProtocolError,
    Role,
)
from fleetrl.common.messages.codec import (  # noqa: F401
    decode_announcement,
    decode_group,
    decode_reply,
    decode_request,
    encode,
    encode_raw,
    peek_header,
    peek_push_count,
    to_dict,
)
from fleetrl.common.messages.groups import (  # noqa: F401
    Prompt,
    SampleGroup,
    build_group,
    check_group,
    nesting_depth,
    pack_logprobs,
    pack_tokens,
    unpack_logprobs,
    unpack_tokens,
)
from fleetrl.common.messages.protocol import (  # noqa: F401
    PUSH_GROUP_TAGS,
    Ack,
    AckBatch,
    Announcement,
    BatchLease,
    ClientInfo,
    Commit,
    Control,
    ControlAnnouncement,
    CurrentVersion,
    Error,
    GetStatus,
    GetVersion,
    GroupAck,
    GroupAcks,
    Heartbeat,
    LeaseBatch,
    LeasePrompts,
    Leave,
    PromptLease,
    PublishVersion,
    PushGroup,
    PushGroups,
    Register,
    Registered,
    Reply,
    Request,
    ReturnPrompts,
    Rewind,
    Status,
    Throttle,
    VersionAnnouncement,
)
from fleetrl.common.messages.weights import (  # noqa: F401
    BucketSeal,
    CatchupOffer,
    JoinRecord,
    ParamSpec,
    RoundPlan,
    WeightsInfo,
    decode_join,
    decode_offer,
    decode_plan,
    decode_seal,
    encode_record,
)
