"""Requests (client -> broker), replies (broker -> client) and announcements (broker PUB).

Requests carry a client-chosen ``req_id``; the broker's reply carries the same ``req_id`` so that one
DEALER socket can have many requests in flight.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from fleetrl.common.messages.base import PROTOCOL_VERSION, ErrorCode, Id, Message, Role
from fleetrl.common.messages.groups import Prompt, SampleGroup
from fleetrl.common.messages.weights import WeightsInfo


class ClientInfo(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    client_id: Id
    role: str
    rank: int = 0
    policy_version: int = 0
    last_seen_s: float = 0.0  # seconds since the last request
    alive: bool = True
    stats: dict[str, float] = {}
    receivers: int = 1  # weight receivers behind this client (a tensor-parallel vLLM server: one per worker)
    counters: dict[str, int] = {}  # about this client id, kept across its re-registrations: implausible/<kind> groups


# ---------------------------------------------------------------- requests (client -> broker)


class Register(Message, tag=1):  # Rollout/Learner -> Broker
    req_id: int
    client_id: Id
    role: Role
    protocol: int = PROTOCOL_VERSION
    rank: int = 0
    info: dict[str, str] = {}


class Heartbeat(Message, tag=2):  # Rollout/Learner -> Broker
    req_id: int
    client_id: Id
    policy_version: int = 0
    stats: dict[str, float] = {}


class LeasePrompts(Message, tag=3):  # Rollout -> Broker
    req_id: int
    client_id: Id
    n: int
    policy_version: int = 0


class PushGroup(Message, tag=4):  # Rollout -> Broker
    req_id: int
    client_id: Id
    group: SampleGroup


class PushGroups(Message, tag=14):  # Rollout -> Broker: several groups in one frame (one ack each)
    req_id: int
    client_id: Id
    groups: list[SampleGroup]


class ReturnPrompts(Message, tag=5):  # Rollout -> Broker (shutdown: give leased prompts back)
    req_id: int
    client_id: Id
    lease_id: Id
    prompt_ids: list[Id] = []  # empty = every prompt of the lease still open
    unscored: bool = False  # no reward function could score them: count them, do not re-issue them


class LeaseBatch(Message, tag=6):  # Learner -> Broker
    req_id: int
    client_id: Id
    n: int  # groups wanted
    wait_s: float = 0.0  # hold the request up to this long for groups to arrive
    min_groups: int = 1  # reply once this many are ready (or at wait_s with what is there)
    # the policy version the batch will be trained at, when the learner leases ahead of its next publish
    # (learner.prefetch): the staleness bound counts from max(this, the newest published version)
    for_version: int = 0


class AckBatch(Message, tag=7):  # Learner -> Broker (trained on the lease)
    req_id: int
    client_id: Id
    lease_id: Id
    step: int = 0
    group_ids: list[Id] = []  # the groups done with; empty = all
    keep_rest: bool = False  # False: the lease closes and groups not listed are requeued; True: they stay leased
    give_back: bool = False  # none trained: the lease closes and all its groups go back to the queue's front


class Commit(Message, tag=8):  # Learner -> Broker (a checkpoint covers every ack up to `step`)
    req_id: int
    client_id: Id
    step: int


class Rewind(Message, tag=9):  # Learner -> Broker (resumed at `step`: requeue uncommitted later acks)
    req_id: int
    client_id: Id
    step: int


class PublishVersion(Message, tag=10):  # Learner rank 0 -> Broker
    req_id: int
    client_id: Id
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)


class Control(Message, tag=11):  # Operator -> Broker (a learner: its rollback's pause, resume, discard; quarantine)
    req_id: int
    client_id: Id
    action: Literal["pause", "resume", "stop", "discard", "quarantine", "release"]
    reason: str = ""
    min_version: int = 0  # discard: the closed range [min_version, max_version] of versions to drop
    max_version: int = -1  # discard: its upper end, at most the broker's current version (-1 is refused)
    target: Id = ""  # quarantine / release: the rollout server's client id


class GetStatus(Message, tag=12):  # anyone -> Broker
    req_id: int
    client_id: Id = ""


class GetVersion(Message, tag=13):  # Rollout -> Broker (late subscriber catches up)
    req_id: int
    client_id: Id = ""


class Leave(Message, tag=15):  # Rollout/Learner -> Broker: this client stops now (graceful exit)
    """The client is gone at once: no longer in the fleet size or the weight-sync rounds, its prompt
    leases re-issued and its batch leases requeued. ``done`` (a learner that finished training): the
    broker announces ``done`` and rollouts exit unless ``rollout.stay_after_done``."""

    req_id: int
    client_id: Id
    reason: str = ""
    done: bool = False


Request = (
    Register
    | Heartbeat
    | LeasePrompts
    | PushGroup
    | PushGroups
    | ReturnPrompts
    | LeaseBatch
    | AckBatch
    | Commit
    | Rewind
    | PublishVersion
    | Control
    | GetStatus
    | GetVersion
    | Leave
)


# ----------------------------------------------------------------- replies (broker -> client)


class Ack(Message, tag=20):  # Broker -> client
    req_id: int
    ref: str = ""  # what was acknowledged (group id, lease id)
    count: int = 0
    duplicate: bool = False  # the group was already held: acked again, enqueued once


class GroupAck(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    group_id: Id
    status: Literal["accepted", "duplicate", "stale", "rejected", "throttled"]  # throttled: not taken, push it later
    reason: str = ""
    code: str = ""  # rejected: why, in one word where it has one (implausible_reward, implausible_logprob)


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
    max_groups_per_push: int = 0  # a PushGroups with more groups is refused; clients split (0 = no limit)
    role: str = ""  # the role the broker grants this client (its key's role under CURVE)
    identity: str = ""  # the key identity the client_id is bound to ("" without CURVE)


class PromptLease(Message, tag=24):  # Broker -> Rollout
    req_id: int
    lease_id: Id
    prompts: list[Prompt]
    expires_in_s: float
    policy_version: int = 0


class BatchLease(Message, tag=25):  # Broker -> Learner
    req_id: int
    lease_id: Id
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
    counters: dict[str, int] = {}  # refusals by cap and role, spool and timer errors, evictions, closed connections
    stats: dict[str, float] = {}  # the broker process's bytes/s in and out and resources (broker/client/metrics.py)
    clients_omitted: int = 0  # client rows left out to keep the reply under broker.max_status_bytes (monitors first)
    stats_omitted: int = 0  # rows listed without their heartbeat stats, for the same reason
    quarantined: dict[str, str] = {}  # rollout server client id -> why it is quarantined


Reply = Ack | Error | Throttle | Registered | PromptLease | BatchLease | CurrentVersion | Status | GroupAcks


# ------------------------------------------------------------ announcements (broker PUB)


class VersionAnnouncement(Message, tag=40):  # Broker -> all (topic "version")
    version: int
    step: int = 0
    weights: WeightsInfo = msgspec.field(default_factory=WeightsInfo)


class ControlAnnouncement(Message, tag=41):  # Broker -> all (topic "control")
    action: Literal["pause", "resume", "stop", "discard", "done"]  # done: the learner finished (or the broker stops)
    reason: str = ""
    min_version: int = 0
    max_version: int = -1


Announcement = VersionAnnouncement | ControlAnnouncement

PUSH_GROUP_TAGS = (PushGroup.__struct_config__.tag, PushGroups.__struct_config__.tag)
