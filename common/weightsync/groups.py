"""The process groups of weight broadcast, built the same way by the learner (root) and every receiver.

A group of its own per round (no ``init_process_group``: the default group is DeepSpeed's), formed
through a PrefixStore on the learner's TCPStore. torch is imported inside the functions, so the
package imports without it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's own way to set a gloo timeout
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


class BucketFailed(RuntimeError):
    """A bucket did not arrive: a peer failed or stalled, it timed out, or the learner aborted the round."""

    have: int  # set by the receiver: the buckets complete and verified before this one (a prefix)


class BucketForged(BucketFailed):
    """A bucket arrived but its bytes are not the ones the learner signed (weightsync.auth): it is dropped."""


def wait_work(work: Any, timeout_s: float, aborted: Callable[[], bool] | None = None, check_s: float = 0.1) -> None:
    """Wait for ``work`` by polling it, so that ``aborted()`` (every ``check_s``) can end the wait early;
    raises BucketFailed on its error, after ``timeout_s``, or when aborted. The work itself is left to
    its own timeout (its group must then be dropped: see ``retire_group``)."""
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + check_s
    sleep = 0.0002
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise BucketFailed(f"no progress within {timeout_s:.1f} s (sync.bucket_timeout_s)")
        if aborted is not None and now >= next_check:
            next_check = now + check_s
            if aborted():
                raise BucketFailed("the learner aborted the round")
        time.sleep(sleep)
        sleep = min(0.002, sleep * 2)
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - a collective that failed: the peer's error, as one type
        raise BucketFailed(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from e


_graveyard: list[tuple[float, Any]] = []  # (drop after, group): groups whose collective may still be running


def retire_group(pg: Any, linger_s: float) -> None:
    """Drop a failed group without blocking: gloo's destructor joins its worker threads, which may still be
    inside a collective until its timeout, so the group is kept for ``linger_s`` first."""
    if pg is None:
        return
    release_group(pg)
    now = time.monotonic()
    _graveyard.append((now + linger_s, pg))
    _graveyard[:] = [(t, g) for t, g in _graveyard if t > now]


def release_group(pg: Any) -> None:
    """Drop a group after a failure: NCCL needs an explicit abort or its destructor may hang."""
    if pg is not None and type(pg).__name__ == "ProcessGroupNCCL":
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - best effort on a group that already failed
            pass
