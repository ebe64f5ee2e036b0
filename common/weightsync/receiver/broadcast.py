"""The receive side of a broadcast round, as functions a vLLM worker can call as well as the rollout's
receiver thread (docs/weight_sync.md#rounds; the store keys are ``weightsync.RoundKeys``):

- :func:`join_round`: prove the round's secret, get this receiver's rank (or ``RoundSkipped``);
- :func:`form_group`: the round's process group (or the one held from an earlier round);
- :func:`receive_buckets`: every bucket from ``start`` on, into the caller's destination buffers,
  reporting progress and watching for the learner's abort;
- :func:`receive_round`: all of it, re-joining the re-formed round when a bucket fails (a dead peer
  costs one bucket timeout, and this receiver still gets the version);
- :func:`request_catchup`: a receiver that missed a round asks the learner for a fresh one.

Everything waits on the learner's TCPStore with deadlines; nothing here touches an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec

from fleetrl.common import faults, messages
from fleetrl.common import weightsync as ws

log = logging.getLogger(__name__)

ABORT_CHECK_S = 0.1  # how often a receiver waiting on a bucket looks for the learner's abort


class RoundSkipped(Exception):
    """This receiver is not part of a round (it came too late, or the learner left it out)."""


@dataclass
class Joined:
    keys: ws.RoundKeys
    plan: messages.RoundPlan
    pg: Any  # the process group; group id is plan.group


def wait_key(store: Any, key: str, deadline: float) -> None:
    store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))


def join_round(
    store: Any, keys: ws.RoundKeys, identity: str, held_group: str, deadline: float, have: int = 0, signer: str = ""
) -> messages.RoundPlan:
    """Join round ``keys`` (proving its secret); its plan once the learner closed it, signed by ``signer``
    (the learner's announced key). Raises RoundSkipped."""
    n = store.add(keys.count, 1)
    if not 0 < n <= ws.MAX_JOINS:
        raise RoundSkipped("the round closed before this server joined")
    record = messages.JoinRecord(identity, held_group, ws.proof(keys.secret, identity), have)
    store.set(keys.member(n), messages.encode_record(record))
    wait_key(store, keys.plan, deadline)
    plan = signed_plan(store, keys, signer, deadline)
    if identity not in plan.ranks:
        raise RoundSkipped("the learner left this server out of the round")
    return plan


def signed_plan(store: Any, keys: ws.RoundKeys, signer: str, deadline: float) -> messages.RoundPlan:
    """The round's plan once one signed by ``signer`` lies under its key: anything else there (another
    rollout knows the round's secret too) is ignored until ``deadline``; raises RoundSkipped then."""
    while True:
        try:
            plan = messages.decode_plan(store.get(keys.plan))
            if ws.verify(signer, ws.auth.plan_message(keys.round_id, plan), plan.sig):
                return plan
        except (msgspec.MsgspecError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RoundSkipped("no round plan signed by the learner came (a forged or garbled one was ignored)")
        time.sleep(0.02)


def check_seal(store: Any, keys: ws.RoundKeys, i: int, buffer: Any, signer: str, timeout_s: float) -> None:
    """Raise BucketForged unless bucket ``i``'s bytes match the digest the learner signed for this round."""
    import torch

    wait_key(store, keys.seal(i), time.monotonic() + timeout_s)
    try:
        seal = messages.decode_seal(store.get(keys.seal(i)))
    except (msgspec.MsgspecError, ValueError) as e:
        raise ws.BucketForged(f"bucket {i}: its seal is garbled ({e})") from e
    if not ws.verify(signer, ws.auth.seal_message(keys.round_id, i, seal.digest), seal.sig):
        raise ws.BucketForged(f"bucket {i}: its seal is not signed by the learner")
    if ws.digest(buffer.detach().reshape(-1).view(torch.uint8).cpu().numpy()) != seal.digest:
        raise ws.BucketForged(f"bucket {i}: its bytes are not the ones the learner signed (dropped)")


def form_group(
    store: Any, keys: ws.RoundKeys, plan: messages.RoundPlan, identity: str, backend: str, host: str, timeout_s: float
) -> Any:
    """The round's own process group (collectives time out after ``timeout_s``: one bucket's budget)."""
    from torch.distributed import PrefixStore

    return ws.new_group(
        backend, PrefixStore(keys.group(plan.group), store), plan.ranks[identity], plan.size, timeout_s, host
    )


def receive_buckets(
    pg: Any,
    buffers: list,
    store: Any,
    keys: ws.RoundKeys,
    start: int,
    bucket_timeout_s: float,
    on_bucket: Callable[[int], None] | None = None,
    signer: str = "",
) -> None:
    """Receive buckets ``start..`` into ``buffers`` (flat tensors, one per bucket), each checked against
    the digest ``signer`` sealed; raises ``BucketFailed(have)`` (``BucketForged`` for a bucket whose bytes
    are not the learner's) with ``.have`` = buckets complete and verified (a prefix)."""
    for i in range(start, len(buffers)):
        work = ws.broadcast(pg, buffers[i], bucket_timeout_s)
        try:
            ws.wait_work(work, bucket_timeout_s, lambda: store.check([keys.abort]), ABORT_CHECK_S)
            check_seal(store, keys, i, buffers[i], signer, bucket_timeout_s)
        except ws.BucketFailed as e:
            e.have = i
            raise
        store.add(keys.progress(i), 1)
        faults.at("rollout.broadcast")
        if on_bucket is not None:
            on_bucket(i)


def receive_round(
    store: Any,
    keys: ws.RoundKeys,
    identity: str,
    buffers: list,
    backend: str,
    host: str,
    bucket_timeout_s: float,
    deadline: float,
    held: Joined | None = None,
    signer: str = "",
) -> Joined:
    """Join round ``keys``, form (or reuse ``held``'s) group, receive every bucket into ``buffers``; on a
    failed bucket, join the re-formed round and receive the rest. Returns the group held afterwards.
    Raises RoundSkipped (not taken into the round: ``held`` is untouched), BucketFailed (the group failed
    and no re-formed round took this receiver: ``held`` is gone) or a store timeout."""
    plan = join_round(store, keys, identity, held.plan.group if held is not None else "", deadline, signer=signer)
    joined = held if held is not None and plan.reuse and held.plan.group == plan.group else None
    for attempt in range(ws.MAX_REFORMS + 1):
        try:
            if joined is None:
                joined = Joined(keys, plan, form_group(store, keys, plan, identity, backend, host, bucket_timeout_s))
            receive_buckets(joined.pg, buffers, store, keys, plan.resume, bucket_timeout_s, signer=signer)
            return joined
        except Exception as e:  # noqa: BLE001 - a bucket or the group's rendezvous failed: try the re-formed round
            have = getattr(e, "have", plan.resume)
            if joined is not None:
                ws.retire_group(joined.pg, 2 * bucket_timeout_s)
            joined = None
            if attempt == ws.MAX_REFORMS:
                raise ws.BucketFailed(f"gave up after {attempt} re-formed rounds ({e})") from e
            log.warning("weight round: bucket %d failed (%s); joining the re-formed round", have, e)
            keys = keys.reform(attempt)
            try:
                plan = join_round(
                    store, keys, identity, "", min(deadline, time.monotonic() + 3 * bucket_timeout_s), have, signer
                )
            except RoundSkipped as skipped:  # the group is gone: not the "never joined" case the caller may retry
                raise ws.BucketFailed(f"the re-formed round went on without this receiver ({skipped})") from skipped
    raise AssertionError("unreachable")  # pragma: no cover


def request_catchup(
    store: Any,
    missed: ws.RoundKeys,
    version: int,
    timeout_s: float,
    tried: Set[int] = frozenset(),
    give_up: Callable[[], bool] = lambda: False,
    signer: str = "",
) -> ws.RoundKeys | None:
    """Ask for a fresh round of ``version`` (the round ``missed`` went by without this receiver); the keys
    of the round the learner offers (not one of ``tried``), or None when none came within ``timeout_s``
    (the learner keeps no host copy, or is gone) or ``give_up()`` (a newer version was announced: its
    round is the better way to catch up)."""
    keys = ws.CatchupKeys(missed.secret, missed.round_id)
    store.add(keys.request, 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not give_up():
        if store.check([keys.offer]):
            try:
                offer = messages.decode_offer(store.get(keys.offer))
            except (msgspec.MsgspecError, ValueError):
                offer = None
            if (
                offer is not None
                and offer.version == version
                and offer.round_id not in tried
                and ws.verify(signer, ws.auth.offer_message(offer), offer.sig)
            ):
                secret = ws.auth.open_secret(missed.secret, f"offer/{offer.round_id}", offer.secret)
                return ws.RoundKeys(secret, offer.round_id)
        time.sleep(0.1)
    return None
