"""What the learner's weight publisher and the rollout's weight receiver agree on (docs/weight_sync.md).

- the **bucket plan**: parameters cut into runs of one dtype, each at most ``sync.bucket_mb``, that
  travel as one flat tensor each (one collective per bucket, not one per parameter);
- the **round protocol** on the TCPStore that learner rank 0 hosts: key names, the join record a
  receiver writes, the plan of the round the learner writes back;
- the **safetensors header** of the filesystem transport, written before the tensors stream in;
- the **process-group helpers** both ends call, so that both build the group the same way.

Round ``r`` on the store (``n`` counts from 1 in join order)::

    learner: announce WeightsInfo(round_id=r)       receiver: n = add(round/r/count, 1)
                                                              set(round/r/member/n, JoinRecord)
    learner: waits for `expected` joins (<= JOIN_WINDOW_S), then closes the round atomically:
             joined = add(round/r/count, CLOSED) - CLOSED       (a later join sees n > CLOSED: too late)
    learner: set(round/r/plan, RoundPlan)            receiver: wait(round/r/plan); rank = plan.ranks[me]
    both:    reuse the previous group (plan.reuse) or form ProcessGroup(prefix group/<id>/, rank, size)
    both:    one broadcast per bucket, root = learner rank 0

This module is pure Python at import time (``common/`` must import without torch); only the
process-group helpers at the bottom import torch, inside the functions.
"""

from __future__ import annotations

import json
import math
import re
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import msgspec

from fleetrl.common.messages import ParamSpec

if TYPE_CHECKING:
    import torch

MB = 1 << 20  # one "MB" of sync.bucket_mb and of the sync/* metrics
JOIN_WINDOW_S = 5.0  # longest wait for `expected_receivers` to join a round
CLOSED = 1 << 40  # added to a round's join counter to close it; a later join reads a count above this

# torch dtype name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"), "float32": (4, "F32"), "bfloat16": (2, "BF16"), "float16": (2, "F16"),
    "float8_e4m3fn": (1, "F8_E4M3"), "float8_e5m2": (1, "F8_E5M2"),
    "int64": (8, "I64"), "int32": (4, "I32"), "int16": (2, "I16"), "int8": (1, "I8"),
    "uint64": (8, "U64"), "uint32": (4, "U32"), "uint16": (2, "U16"), "uint8": (1, "U8"), "bool": (1, "BOOL"),
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
                return (f"the learner sends {spec.name!r}, which this rollout's model does not have; "
                        "learner and rollout must load the same architecture (model.path)")
            shape = tuple(expected[spec.name][0])
            if tuple(spec.shape) != shape:
                return f"the learner sends {spec.name!r} with shape {tuple(spec.shape)} but this model has {shape}"
    return None


# ------------------------------------------------------------------------- round protocol


def count_key(round_id: int) -> str:
    return f"round/{round_id}/count"


def member_key(round_id: int, n: int) -> str:
    return f"round/{round_id}/member/{n}"


def plan_key(round_id: int) -> str:
    return f"round/{round_id}/plan"


def group_prefix(group_id: str) -> str:
    return f"group/{group_id}/"


class JoinRecord(msgspec.Struct, gc=False):
    """Receiver -> learner (TCPStore): who joined, and which group it still holds ("" = none)."""

    identity: str  # client id plus a per-process nonce: a restarted rollout is a new member
    group: str = ""


class RoundPlan(msgspec.Struct, gc=False):
    """Learner -> receivers (TCPStore): the group of this round and each member's rank in it."""

    group: str
    size: int  # 1 + receivers
    ranks: dict[str, int]  # identity -> rank (1..size-1); the learner is rank 0
    reuse: bool = False  # the members already hold `group` from an earlier round


_join_decoder = msgspec.json.Decoder(JoinRecord)
_plan_decoder = msgspec.json.Decoder(RoundPlan)


def encode_record(record: JoinRecord | RoundPlan) -> bytes:
    return msgspec.json.encode(record)


def decode_join(buf: bytes) -> JoinRecord:
    return _join_decoder.decode(buf)


def decode_plan(buf: bytes) -> RoundPlan:
    return _plan_decoder.decode(buf)


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


# ------------------------------------------------------------------- process groups (torch)


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host`` (no packet is sent)."""
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return host


def new_group(backend: str, store: Any, rank: int, size: int, timeout_s: float, host: str) -> Any:
    """A process group of its own (no ``init_process_group``: the default group is DeepSpeed's),
    rendezvousing through ``store`` (a PrefixStore unique to the group). ``host`` is the address
    this process's gloo device binds to. Blocks until every member arrived or ``timeout_s``."""
    from torch.distributed import ProcessGroupGloo

    timeout = timedelta(seconds=max(timeout_s, 0.1))
    if backend == "gloo":
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        import os

        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # A timed-out collective must fail this group, not kill the process (torch's default mode 3
        # tears the process down). The mode is read when the group is built, so scope it to ours.
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # CleanUpOnly: abort the comm, raise in wait()
        try:
            return ProcessGroupNCCL(store, rank, size, opts)
        finally:
            if before is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before
    raise ValueError(f"sync.transport: unknown broadcast backend {backend!r}; valid: gloo, nccl")


def broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float) -> Any:
    """Start a broadcast of ``tensor`` from rank 0 of ``pg``; returns the work (see `wait`)."""
    from torch._C._distributed_c10d import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=max(timeout_s, 0.1))
    return pg.broadcast([tensor], opts)


def wait(work: Any, timeout_s: float) -> None:
    """Block until ``work`` is done (NCCL too: the data is in place when this returns); raises on
    failure or after ``timeout_s``."""
    work.wait(timedelta(seconds=max(timeout_s, 0.1)))


def release_group(pg: Any) -> None:
    """Drop a group after a failure: NCCL needs an explicit abort or its destructor may hang."""
    if pg is not None and type(pg).__name__ == "ProcessGroupNCCL":
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - best effort on a group that already failed
            pass
