"""What weight sync puts on the wire: the parameter specs and ``WeightsInfo`` of a version (in broker
messages), and the records a receiver and the learner exchange on the learner's TCPStore for one
broadcast round (docs/weight_sync.md)."""

from __future__ import annotations

from typing import Literal

import msgspec


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
    published_at: float = (
        0.0  # stamped by the broker when it relays the version: orders versions across resumes and rollbacks
    )
    secret: str = ""  # broadcast: the round's secret (hex); only holders find the round's keys on the TCPStore
    traces: list[dict[str, str]] = []  # W3C contexts of the publish spans in (some of) the trained groups' traces
    signer: str = ""  # broadcast: the learner's Ed25519 public key (hex); plans and buckets must verify under it


class JoinRecord(msgspec.Struct, gc=False):  # Rollout -> Learner (TCPStore)
    """Who joined a broadcast round, which group it still holds ("" = none), and (in a re-formed round)
    how many of the version's buckets it already holds."""

    identity: str  # client id plus a per-process nonce: a restarted rollout is a new member
    group: str = ""
    proof: str = ""  # weightsync.proof(round secret, identity): the learner ignores records without it
    have: int = 0


class RoundPlan(msgspec.Struct, gc=False):  # Learner -> Rollout (TCPStore)
    """The group of this round, each member's rank in it, and the first bucket to be sent."""

    group: str
    size: int  # 1 + receivers
    ranks: dict[str, int]  # identity -> rank (1..size-1); the learner is rank 0
    reuse: bool = False  # the members already hold `group` from an earlier round
    resume: int = 0  # a re-formed round: buckets from this one on are (re)sent
    sig: str = ""  # the learner's signature over weightsync.auth.plan_message(round_id, plan)


class BucketSeal(msgspec.Struct, gc=False):  # Learner -> Rollout (TCPStore)
    """The SHA-256 of one bucket's bytes, signed by the learner: a receiver keeps a bucket only if it matches."""

    digest: str
    sig: str


class CatchupOffer(msgspec.Struct, gc=False):  # Learner -> Rollout (TCPStore): a fresh round of the last version
    round_id: int
    secret: str  # sealed: weightsync.auth.seal_secret(missed round's secret, ...): never in clear in the store
    version: int
    sig: str = ""  # the learner's signature over weightsync.auth.offer_message(offer)


_join_decoder = msgspec.json.Decoder(JoinRecord)
_plan_decoder = msgspec.json.Decoder(RoundPlan)
_offer_decoder = msgspec.json.Decoder(CatchupOffer)
_seal_decoder = msgspec.json.Decoder(BucketSeal)


def encode_record(record: JoinRecord | RoundPlan | CatchupOffer | BucketSeal) -> bytes:
    return msgspec.json.encode(record)


def decode_join(buf: bytes) -> JoinRecord:
    """Raises msgspec errors on anything else (the learner counts those as unknown joiners)."""
    return _join_decoder.decode(buf)


def decode_plan(buf: bytes) -> RoundPlan:
    return _plan_decoder.decode(buf)


def decode_offer(buf: bytes) -> CatchupOffer:
    return _offer_decoder.decode(buf)


def decode_seal(buf: bytes) -> BucketSeal:
    return _seal_decoder.decode(buf)
