"""Who may write a broadcast round: only the learner (docs/weight_sync.md#who-can-write-a-round).

The TCPStore of weight sync is open to whoever reaches ``sync.master_addr`` (torch's store has no
authentication, and ``list_keys`` shows every key name), and every rollout of a round knows its secret.
So nothing a receiver acts on is trusted because of where it lies in the store:

- the learner's process holds an Ed25519 key of its own (:class:`Signer`); its public half rides in every
  ``WeightsInfo``, which reaches rollouts only through the authenticated broker (the broker vouches
  for it: only a learner key may announce a version);
- the learner signs each round's plan (:func:`plan_message`) and, per bucket, the SHA-256 digest of the
  bucket's bytes (:func:`seal_message`); a receiver takes a plan and keeps a bucket only when the
  signature verifies under the announced key and the digest matches what arrived;
- a catch-up offer names a fresh round secret: it is stored sealed (:func:`seal_secret`, a pad derived
  from the missed round's secret), never in clear, and signed.

``cryptography`` is imported inside the functions, so ``fleetrl.common`` imports light.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec


class Signer:
    """The learner's signing key (one per process; never written anywhere)."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._key = Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()


def verify(public: str, message: bytes, signature: str) -> bool:
    """True when ``signature`` (hex) is ``public``'s (hex) over ``message``; False for anything malformed."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(bytes.fromhex(signature), message)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def plan_message(round_id: int, plan: Any) -> bytes:
    """What the learner signs for a round's plan: the round id and every field but the signature."""
    return b"fleetrl/plan/%d/" % round_id + msgspec.json.encode(msgspec.structs.replace(plan, sig=""))


def seal_message(round_id: int, bucket: int, digest: str) -> bytes:
    """What the learner signs for bucket ``bucket`` of round ``round_id``: the digest of its bytes."""
    return f"fleetrl/bucket/{round_id}/{bucket}/{digest}".encode()


def offer_message(offer: Any) -> bytes:
    return b"fleetrl/offer/" + msgspec.json.encode(msgspec.structs.replace(offer, sig=""))


def digest(data: Any) -> str:
    """SHA-256 (hex) of a bytes-like object (a flat bucket's bytes)."""
    return hashlib.sha256(data).hexdigest()


def _pad(secret: str, what: str, n: int) -> bytes:
    return hmac.new(bytes.fromhex(secret), ("fleetrl/pad/" + what).encode(), hashlib.sha256).digest()[:n]


def seal_secret(key_secret: str, what: str, secret: str) -> str:
    """``secret`` (hex, at most 32 bytes) hidden under a pad only holders of ``key_secret`` can compute."""
    raw = bytes.fromhex(secret)
    return bytes(a ^ b for a, b in zip(raw, _pad(key_secret, what, len(raw)))).hex()


def open_secret(key_secret: str, what: str, sealed: str) -> str:
    return seal_secret(key_secret, what, sealed)  # a XOR pad is its own inverse
