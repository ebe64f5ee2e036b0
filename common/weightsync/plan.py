"""The plan of weight sync: what the learner's weight publisher and the rollout's weight receiver agree on (docs/weight_sync.md).

- the **bucket plan**: parameters cut into runs of one dtype, each at most ``sync.bucket_mb``, that
  travel as one flat tensor each (one collective per bucket, not one per parameter);
- the **round protocol** on the TCPStore that learner rank 0 hosts (docs/weight_sync.md#rounds): key
  names derived from each round's secret, so that only receivers the broker gave the secret find them;
- the **safetensors header** of the filesystem transport, written before the tensors stream in;

Round ``r`` with secret ``S`` (announced through the broker, never written to the store); ``K`` =
``RoundKeys(S, r)``, every key below under ``round/<hmac(S, r)>/``::

    learner: announce WeightsInfo(round_id=r, secret=S)   receiver: n = add(K.count, 1)
                                                                   set(K.member(n), JoinRecord(proof=hmac(S, id)))
    learner: waits for `expected` joins (<= JOIN_WINDOW_S), then closes the round atomically:
             joined = add(K.count, CLOSED) - CLOSED        (a later join sees n > CLOSED: too late)
             ignores (and counts) records whose proof is wrong
    learner: set(K.plan, RoundPlan)                         receiver: wait(K.plan); rank = plan.ranks[me]
    both:    reuse the previous group (plan.reuse) or form ProcessGroup(prefix K.group(id), rank, size)
    both:    one broadcast per bucket (root = learner); each receiver add(K.progress(i), 1) after bucket i,
             and the learner starts bucket i only once every receiver finished bucket i - 2
    failure: a bucket not done within sync.bucket_timeout_s (a dead or stalled receiver): the learner
             sets K.abort; survivors see it and join the re-formed round K.reform(a) (the same steps,
             with JoinRecord.have = buckets they hold); the learner forms a group of those who came
             within one bucket timeout and resends from plan.resume, the first bucket any of them
             lacks (it still holds the last two; the window above guarantees that is enough).

A receiver that missed a round asks for a **catch-up**: add(C.request, 1) with C = ``CatchupKeys(S, r)``
of the round it missed; the learner (gloo, from a host copy of the last version) writes
C.offer = CatchupOffer(round_id, secret) of a fresh round and serves it like any other.

The records themselves (``JoinRecord``, ``RoundPlan``) are wire messages (``common/messages/weights.py``);
the process groups both ends build are in ``groups.py``. Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetrl.common.messages import ParamSpec

MB = 1 << 20  # one "MB" of sync.bucket_mb and of the sync/* metrics
JOIN_WINDOW_S = 5.0  # longest wait for `expected_receivers` to join a round
CLOSED = 1 << 40  # added to a round's join counter to close it; a later join reads a count above this

# torch dtype name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "bfloat16": (2, "BF16"),
    "float16": (2, "F16"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint64": (8, "U64"),
    "uint32": (4, "U32"),
    "uint16": (2, "U16"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(dtype: Any) -> int:
    name = dtype_name(dtype)
    if name not in DTYPES:
        raise ValueError(f"weight sync cannot send dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name][0]


def spec_numel(spec: ParamSpec) -> int:
    return math.prod(spec.shape)


def spec_bytes(spec: ParamSpec) -> int:
    return spec_numel(spec) * dtype_bytes(spec.dtype)


def make_spec(name: str, shape: Sequence[int], dtype: Any) -> ParamSpec:
    return ParamSpec(name=name, shape=[int(d) for d in shape], dtype=dtype_name(dtype))


# ----------------------------------------------------------------------------------- buckets


def plan_buckets(specs: Sequence[ParamSpec], bucket_bytes: int) -> list[list[ParamSpec]]:
    """Cut ``specs`` into consecutive buckets, in order: each holds one dtype and at most
    ``bucket_bytes`` bytes, except that a tensor larger than that travels alone in its own bucket.

    The order is kept because the learner yields tensors in ``specs`` order (under ZeRO-3 each
    one is gathered as it is yielded), so a bucket can be sent as soon as its last tensor arrives.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive (got {bucket_bytes} bytes); raise sync.bucket_mb")
    buckets: list[list[ParamSpec]] = []
    size = 0
    for spec in specs:
        nbytes = spec_bytes(spec)
        if not buckets or buckets[-1][0].dtype != spec.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += nbytes
    return buckets


def plan_bytes(buckets: Sequence[Sequence[ParamSpec]]) -> int:
    return sum(spec_bytes(s) for bucket in buckets for s in bucket)


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in its bucket's flat tensor: elements ``[offset, offset + numel)``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    dtype: str
    numel: int  # elements of the flat tensor
    slots: tuple[Slot, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


def bucket_layout(bucket: Sequence[ParamSpec]) -> BucketLayout:
    """The flat tensor of one bucket of a plan: its dtype, length and where each tensor lies in it."""
    if not bucket:
        raise ValueError("empty bucket in a weight plan")
    dtypes = {s.dtype for s in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"bucket mixes dtypes {sorted(dtypes)}; a bucket travels as one flat tensor of one dtype")
    slots, offset = [], 0
    for spec in bucket:
        n = spec_numel(spec)
        slots.append(Slot(spec.name, tuple(spec.shape), offset, n))
        offset += n
    return BucketLayout(bucket[0].dtype, offset, tuple(slots))


def check_plan(buckets: Sequence[Sequence[ParamSpec]], expected: Mapping[str, tuple[Sequence[int], Any]]) -> str | None:
    """Why a receiver whose model has ``expected`` (name -> (shape, dtype)) cannot take this plan, or
    None. Names and shapes must match; a dtype may differ (the engine converts while copying)."""
    seen: set[str] = set()
    for bucket in buckets:
        for spec in bucket:
            if spec.name in seen:
                return f"the plan sends {spec.name!r} twice"
            seen.add(spec.name)
            if spec.name not in expected:
                return (
                    f"the learner sends {spec.name!r}, which this rollout's model does not have; "
                    "learner and rollout must load the same architecture (model.path)"
                )
            shape = tuple(expected[spec.name][0])
            if tuple(spec.shape) != shape:
                return f"the learner sends {spec.name!r} with shape {tuple(spec.shape)} but this model has {shape}"
    return None


# ------------------------------------------------------------------------- round protocol

MAX_REFORMS = 2  # re-formed groups per round after a failed bucket; then the round fails
MAX_JOINS = 4096  # receivers one round takes; a join counter read above it was tampered with
MAX_KEY_CHARS = 256  # longer store keys are nobody's: the learner's sweep deletes them


def tag(secret: str, what: str) -> str:
    """A name only holders of ``secret`` can compute (HMAC-SHA256, 96 bits shown)."""
    return hmac.new(bytes.fromhex(secret), what.encode(), hashlib.sha256).hexdigest()[:24]


def new_secret() -> str:
    return secrets.token_hex(16)


def proof(secret: str, identity: str) -> str:
    """What a receiver writes to show it knows the round's secret."""
    return tag(secret, "join/" + identity)


@dataclass(frozen=True)
class RoundKeys:
    """The store keys of one broadcast round (see the module docstring)."""

    secret: str
    round_id: int

    @property
    def root(self) -> str:
        return f"round/{tag(self.secret, f'round/{self.round_id}')}/"

    @property
    def count(self) -> str:
        return self.root + "count"

    def member(self, n: int) -> str:
        return f"{self.root}member/{n}"

    @property
    def plan(self) -> str:
        return self.root + "plan"

    def group(self, group_id: str) -> str:
        return f"group/{tag(self.secret, 'group/' + group_id)}/"

    def progress(self, bucket: int) -> str:
        return f"{self.root}progress/{bucket}"

    def seal(self, bucket: int) -> str:
        return f"{self.root}seal/{bucket}"

    @property
    def abort(self) -> str:
        return self.root + "abort"

    def reform(self, attempt: int) -> RoundKeys:
        """The keys of the round re-formed after a failure of this one (same secret, a derived id)."""
        return RoundKeys(self.secret, (self.round_id + 1) * 16 + attempt + (1 << 48))


@dataclass(frozen=True)
class CatchupKeys:
    """Where receivers that missed round ``round_id`` ask for a catch-up, and where the learner offers one."""

    secret: str
    round_id: int

    @property
    def request(self) -> str:
        return f"catchup/{tag(self.secret, f'catchup/{self.round_id}')}/request"

    @property
    def offer(self) -> str:
        return f"catchup/{tag(self.secret, f'catchup/{self.round_id}')}/offer"


# ------------------------------------------------------------------------------ filesystem

WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def version_dir(version: int) -> str:
    return f"v{version}"


def versions_to_prune(names: Sequence[str], keep: int) -> list[str]:
    """The ``v<N>`` names among ``names`` beyond the newest ``keep`` (other names are never touched)."""
    versions = sorted((int(m.group(1)), n) for n in names if (m := _VERSION_DIR.match(n)))
    return [n for _, n in versions[: max(0, len(versions) - keep)]]


def safetensors_header(specs: Sequence[ParamSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``specs`` back to back, in order.

    Knowing the header before any tensor lets the publisher stream each tensor to disk as it is
    yielded instead of holding the whole model in memory.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        end = offset + spec_bytes(spec)
        header[spec.name] = {"dtype": DTYPES[spec.dtype][1], "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
