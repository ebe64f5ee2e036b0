"""The broadcast transports (``gloo`` / ``nccl``) of the weight publisher: rounds on rank 0's TCPStore.

One round per publish (docs/weight_sync.md#rounds, keys in ``weightsync.plan``):

1. The announcement carries a fresh per-round secret (it reaches rollouts only through the
   authenticated broker); receivers join under keys derived from it and prove it, and records that do
   not are ignored and counted (``sync/unknown_joiners``). The store listens on ``sync.master_addr``
   only.
2. The learner forms (or reuses) the group with who joined and broadcasts one flat tensor per bucket,
   one in flight while it packs the next; it starts bucket ``i`` only once every receiver reported
   bucket ``i - 2`` done, so at any failure it still holds every bucket a survivor may lack.
3. A bucket not done within ``sync.bucket_timeout_s`` (a receiver died or stalled) aborts the round's
   group: survivors join a re-formed round (one bucket timeout to come), the learner resends from
   the first bucket any of them lacks and carries on. A dead receiver costs about one to two bucket
   timeouts, and everybody else gets the version.
4. With ``sync.catchup`` the buckets of the last version stay in host memory, and a thread serves
   **catch-up rounds** (gloo) to receivers that missed a round: a rollout that fell behind catches up
   without waiting for (or holding back) the next publish.

A receiver must never crash the learner: every failure ends in a logged, counted, failed round.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from fleetrl.common import faults, messages
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import SyncConfig

if TYPE_CHECKING:  # torch is imported where it is used: this package imports without it
    import torch
    from torch.distributed import TCPStore

log = logging.getLogger("fleetrl.common.weightsync.sender.publisher")

Announce = Callable[[messages.WeightsInfo], None]
Tensors = Iterator[tuple[messages.ParamSpec, "torch.Tensor"]]
CATCHUP_POLL_S = 0.5
SETTLE_S = 1.0  # after a round that closed short: how long the next waits once as many have joined as then


@dataclass
class Sent:
    """What one sender did in a round: bytes sent (or written), seconds it took, receivers reached."""

    nbytes: int = 0
    seconds: float = 0.0
    receivers: int = 0
    failed: bool = False
    unknown_joiners: int = 0
    tampered: int = 0  # store counters read out of range (a non-member wrote them): ignored, bounded
    reforms: int = 0
    dropped: int = 0  # receivers the round lost (dead, or too far behind at a re-form)


@dataclass
class Group:
    id: str
    size: int
    ranks: dict[str, int]  # identity -> rank
    pg: Any
    prefix: str = ""  # its store keys (kept by the sweep while the group lives)


@dataclass
class Round:
    """One round in progress: its keys, group and the last two packed buckets (for a resend)."""

    keys: ws.RoundKeys
    group: Group | None
    held: dict[int, torch.Tensor] = field(default_factory=dict)
    sent: Sent = field(default_factory=Sent)
    resume: int = 0  # the first bucket this group receives (after a re-form)


def bound_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A TCPStore server listening on ``host`` only (TCPStore alone binds every interface); it takes over
    the listening socket."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    port = listener.getsockname()[1]
    return TCPStore(
        host,
        port,
        None,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )


class BroadcastSender:
    """Hosts the round TCPStore, forms or reuses the group, broadcasts the buckets (module docstring)."""

    def __init__(self, cfg: SyncConfig, run_dir: Path, plan: list[list[messages.ParamSpec]]):
        import torch

        self.cfg, self.plan = cfg, plan
        self.layouts = [ws.bucket_layout(b) for b in plan]
        nccl = cfg.transport == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._store: TCPStore | None = None
        self._group: Group | None = None
        self._round = 0
        self._old_keys: list[list[str]] = []  # keys of recent rounds, deleted two rounds later
        self._lock = threading.Lock()  # a publish and a catch-up round never overlap
        # gloo: two CPU staging buffers, one being sent while the next is packed (fresh pages cost ~5x the
        # copy); with sync.catchup one buffer per bucket instead: the last version stays for catch-ups
        self._host: list[torch.Tensor] = []
        if self.layouts and (cfg.catchup or self.device.type == "cpu"):
            pin = self.device.type == "cuda"
            sizes = (
                [lay.nbytes for lay in self.layouts] if cfg.catchup else [max(lay.nbytes for lay in self.layouts)] * 2
            )
            self._host = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
        self._last: tuple[int, ws.RoundKeys] | None = None  # the version the host copy holds, and its round
        self._served = 0  # catch-up requests answered for that round
        self._closed = threading.Event()
        self._catchup: threading.Thread | None = None
        self._signer = ws.Signer()  # plans and bucket digests are signed; receivers verify (weightsync/auth.py)
        self._digests: dict[int, str] = {}  # bucket -> SHA-256 of the last packed version's bytes
        self._live: list[str] = []  # store key prefixes of recent rounds; the sweep deletes every other key
        self._publishing = threading.Event()  # a publish waits: a catch-up round stops waiting for joins
        # receivers the last publish round closed with, when it closed short of the expected count (None: it
        # filled): the next round waits only SETTLE_S more once as many have joined
        self._short_of: int | None = None

    @property
    def port(self) -> int:
        return self._store.port if self._store is not None else 0

    # ---------------------------------------------------------------------------------- a publish
    def send(self, version: int, step: int, tensors: Tensors, announce: Announce, expected: int) -> Sent:
        import torch

        self._publishing.set()
        with self._lock:
            self._publishing.clear()
            store = self._ensure_store()
            keys = self._next_round()
            self._sweep(store)
            self._last = None  # the host copy is overwritten now
            deadline = time.monotonic() + self.cfg.timeout_s
            announce(
                messages.WeightsInfo(
                    transport=self.cfg.transport,
                    published_at=time.time(),
                    secret=keys.secret,
                    master_addr=self.cfg.master_addr,
                    master_port=self.port,
                    buckets=self.plan,
                    round_id=keys.round_id,
                    signer=self._signer.public,
                )
            )
            rnd = Round(keys, None)
            t0 = time.perf_counter()
            # the first bucket is packed (copied and digested) while the receivers join, not after: the
            # broker counts every rollout a version behind until its round ends (issue 24)
            first = None
            if self.layouts:
                first = self._pack(self.layouts[0], [next(tensors)[1] for _ in self.layouts[0].slots], 0)
            members: list[messages.JoinRecord] = []  # stays empty when closing the round raises
            try:
                members = self._close_round(store, keys, expected, deadline, rnd.sent, settle_at=self._short_of)
                self._short_of = len(members) if len(members) < expected else None
                if members:
                    rnd.group = self._group_for(store, keys, members, rnd)
            except Exception as e:  # noqa: BLE001 - a receiver must never crash the learner
                log.warning(
                    "weight sync round %d (version %d): could not form the group (%s); rollouts keep their "
                    "weights until the next round",
                    keys.round_id,
                    version,
                    e,
                )
                self._drop_group()
            ok = self._stream(store, rnd, tensors, bool(members), first)
            sent = rnd.sent
            sent.seconds = time.perf_counter() - t0
            if self.cfg.catchup and self._host:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the host copy's D2H copies are done
                self._last, self._served = (version, keys), 0
                self._start_catchup()
            if rnd.group is None or not ok:
                sent.failed = bool(members)
                return sent
            sent.nbytes, sent.receivers = sum(lay.nbytes for lay in self.layouts), rnd.group.size - 1
            return sent

    def _next_round(self) -> ws.RoundKeys:
        self._round += 1
        for key in self._old_keys.pop(0) if len(self._old_keys) >= 2 else []:  # every receiver of it has read them
            cast("TCPStore", self._store).delete_key(key)  # made by _ensure_store before any round
        keys = ws.RoundKeys(ws.new_secret(), self._round)
        self._keep(keys.root)
        self._keep(ws.CatchupKeys(keys.secret, keys.round_id).request.removesuffix("request"))
        return keys

    def _keep(self, prefix: str) -> None:
        """Keys under ``prefix`` survive the sweep (the prefixes of the last few rounds and groups)."""
        self._live = (self._live + [prefix])[-32:]

    def _sweep(self, store: TCPStore) -> int:
        """Delete every key that no recent round of ours wrote or asked for (a non-member's SETs): what an
        outsider stores costs the learner's memory only until the next publish or catch-up poll."""
        live = tuple(self._live) + ((self._group.prefix,) if self._group is not None else ())
        swept: list[str] = []
        for key in store.list_keys():
            if len(key) > ws.MAX_KEY_CHARS or not key.startswith(live):
                store.delete_key(key)
                swept.append(key)
        if swept:
            log.warning(
                "weight sync: deleted %d store key(s) that no round of this learner uses (someone who can "
                "reach sync.master_addr wrote them): %s",
                len(swept),
                ", ".join(repr(k[:48]) for k in swept[:3]),
            )
        return len(swept)

    def _set_plan(self, store: TCPStore, keys: ws.RoundKeys, plan: messages.RoundPlan) -> None:
        """Sign and publish a round's plan: receivers take only a plan that verifies under the announced key."""
        plan.sig = self._signer.sign(ws.auth.plan_message(keys.round_id, plan))
        store.set(keys.plan, messages.encode_record(plan))  # type: ignore[arg-type]  # bytes (stub: str)

    def _seal(self, store: TCPStore, keys: ws.RoundKeys, i: int) -> None:
        """Sign bucket ``i``'s digest for this round: receivers keep the bucket only if its bytes match."""
        dig = self._digests[i]
        sig = self._signer.sign(ws.auth.seal_message(keys.round_id, i, dig))
        seal = messages.encode_record(messages.BucketSeal(dig, sig))
        store.set(keys.seal(i), seal)  # type: ignore[arg-type]  # bytes (stub: str)

    def _ensure_store(self) -> TCPStore:
        if self._store is None:
            self._store = bound_store(self.cfg.master_addr, self.cfg.master_port, self.cfg.timeout_s)
            log.info(
                "weight sync: %s rounds on TCPStore %s:%d", self.cfg.transport, self.cfg.master_addr, self._store.port
            )
        return self._store

    def _close_round(
        self,
        store: TCPStore,
        keys: ws.RoundKeys,
        expected: int,
        deadline: float,
        sent: Sent,
        window_s: float = ws.JOIN_WINDOW_S,
        settle_at: int | None = None,
    ) -> list[messages.JoinRecord]:
        """Wait for ``expected`` joins (at most ``window_s``), close the round, read who joined and proved it.

        ``settle_at``: once that many joined, wait at most SETTLE_S more. A registered receiver that did not
        join the last round (its server stuck, or busy in a catch-up) would otherwise cost every round the whole
        window; if it joins late it asks for a catch-up round, and a round that fills ends the shortcut."""
        window_end = min(time.monotonic() + window_s, deadline)
        expected = min(expected, ws.MAX_JOINS)
        settling = settle_at is None
        while (
            expected > 0
            and 0 <= (count := store.add(keys.count, 0)) < expected
            and time.monotonic() < window_end
            and not self._publishing.is_set()
        ):  # a catch-up round does not hold back a publish
            if settle_at is not None and not settling and count >= settle_at:
                settling, window_end = True, min(window_end, time.monotonic() + SETTLE_S)
            time.sleep(0.001)
        joined = store.add(keys.count, ws.CLOSED) - ws.CLOSED
        if 0 <= joined <= ws.MAX_JOINS:
            member_keys = [keys.member(n) for n in range(1, joined + 1)]
        else:  # a non-member added to the counter (closed or inflated it): take the slots that were written
            sent.tampered += 1
            log.warning(
                "weight sync round %d: its join counter reads %d (a non-member wrote it); taking only the "
                "join records present",
                keys.round_id,
                joined,
            )
            member_keys = self._written_slots(store, keys)
        n_seals = len(self.layouts)
        asked = ws.CatchupKeys(keys.secret, keys.round_id)  # the catch-up poll's add(request, 0) makes its key
        self._old_keys.append(
            member_keys
            + [keys.plan, keys.abort, keys.count, asked.request, asked.offer]
            + [keys.progress(i) for i in range(n_seals)]
            + [keys.seal(i) for i in range(n_seals)]
        )
        if member_keys:
            try:
                store.wait(member_keys, timedelta(seconds=max(0.1, min(2.0, deadline - time.monotonic()))))
            except Exception:  # noqa: BLE001 - a receiver died between joining and writing its record
                pass
        members, seen = [], set()
        for k in member_keys:
            record = self._member(store, k, keys)
            if record is None:
                sent.unknown_joiners += 1
            elif record.identity not in seen:
                seen.add(record.identity)
                members.append(record)
        if sent.unknown_joiners:
            log.warning(
                "weight sync round %d: ignored %d join record(s) that did not prove the round's secret",
                keys.round_id,
                sent.unknown_joiners,
            )
        if member_keys and not members:
            self._set_plan(store, keys, messages.RoundPlan(group="", size=1, ranks={}))
        return members

    @staticmethod
    def _written_slots(store: TCPStore, keys: ws.RoundKeys, gap: int = 64) -> list[str]:
        """The member slots present, scanned from 1 until ``gap`` missing in a row (at most MAX_JOINS)."""
        found, missing = [], 0
        for n in range(1, ws.MAX_JOINS + 1):
            if store.check([keys.member(n)]):
                found.append(keys.member(n))
                missing = 0
            elif (missing := missing + 1) >= gap:
                break
        return found

    @staticmethod
    def _member(store: TCPStore, key: str, keys: ws.RoundKeys) -> messages.JoinRecord | None:
        if not store.check([key]):
            return None
        try:
            record = messages.decode_join(store.get(key))
        except (msgspec.MsgspecError, ValueError):
            return None
        return record if record.proof == ws.proof(keys.secret, record.identity) else None

    def _group_for(
        self,
        store: TCPStore,
        keys: ws.RoundKeys,
        members: list[messages.JoinRecord],
        rnd: Round,
        resume: int = 0,
        reuse_ok: bool = True,
    ) -> Group:
        """The previous group when the same members hold it, else a new one (published in the plan)."""
        from torch.distributed import PrefixStore

        prev = self._group
        idents = [m.identity for m in members]
        if (
            reuse_ok
            and prev is not None
            and set(idents) == set(prev.ranks)
            and all(m.group == prev.id for m in members)
        ):
            self._set_plan(store, keys, messages.RoundPlan(prev.id, prev.size, prev.ranks, reuse=True))
            return prev
        self._drop_group()
        ranks = {ident: i for i, ident in enumerate(idents, start=1)}
        plan = messages.RoundPlan(group=str(keys.round_id), size=len(ranks) + 1, ranks=ranks, resume=resume)
        self._set_plan(store, keys, plan)
        pg = ws.new_group(
            self.cfg.transport,
            PrefixStore(keys.group(plan.group), store),
            0,
            plan.size,
            self.cfg.bucket_timeout_s,
            self.cfg.master_addr,
        )
        self._group = Group(plan.group, plan.size, ranks, pg, keys.group(plan.group))
        log.info("weight sync: new %s group %s with %d receivers", self.cfg.transport, plan.group, len(ranks))
        return self._group

    # ------------------------------------------------------------------------------ streaming
    def _stream(self, store: TCPStore, rnd: Round, tensors: Tensors, live: bool, first: Any = None) -> bool:
        """Pack and broadcast each bucket (``first``: bucket 0, packed already), recovering from a failed
        bucket by re-forming; consumes every tensor whatever happens (and fills the host copy). False when
        the round failed."""
        inflight = None
        failed = rnd.group is None
        for i, layout in enumerate(self.layouts):
            if i == 0 and first is not None:
                flat = first
            else:
                chunk = [next(tensors)[1] for _ in layout.slots]
                if failed and not self.cfg.catchup:
                    continue
                flat = self._pack(layout, chunk, i)
            rnd.held[i] = flat
            rnd.held.pop(i - 2, None)
            if failed:
                continue
            try:
                if inflight is not None:
                    ws.wait_work(inflight, self.cfg.bucket_timeout_s)
                self._window(store, rnd, i)
                self._seal(store, rnd.keys, i)
                inflight = ws.broadcast(cast(Group, rnd.group).pg, flat, self.cfg.bucket_timeout_s)
                if i == 1:
                    faults.at("learner.publish")
            except Exception as e:  # noqa: BLE001 - a receiver died or stalled: re-form without it
                inflight = None
                failed = not self._reform(store, rnd, i, e)
        if inflight is not None and not failed:
            try:
                ws.wait_work(inflight, self.cfg.bucket_timeout_s)
                self._window(store, rnd, len(self.layouts) + 1)
            except Exception as e:  # noqa: BLE001
                failed = not self._reform(store, rnd, len(self.layouts), e)
        return not failed and live

    def _window(self, store: TCPStore, rnd: Round, i: int) -> None:
        """Start bucket ``i`` only once every receiver finished bucket ``i - 2`` (at most one bucket timeout)."""
        if i - 2 < rnd.resume or rnd.group is None:
            return
        key, need = rnd.keys.progress(i - 2), rnd.group.size - 1
        deadline = time.monotonic() + self.cfg.bucket_timeout_s
        while store.add(key, 0) < need:
            if time.monotonic() > deadline:
                raise ws.BucketFailed(f"receivers did not finish bucket {i - 2} within sync.bucket_timeout_s")
            time.sleep(0.0005)

    def _reform(self, store: TCPStore, rnd: Round, i: int, error: Exception) -> bool:
        """Bucket ``i`` failed: abort the group, re-form with the survivors, resend what they lack (buckets
        ``resume..i``, still held). True when the round goes on."""
        lowest = min(rnd.held) if rnd.held else i
        for attempt in range(ws.MAX_REFORMS):
            log.warning(
                "weight sync round %d: bucket %d failed (%s); re-forming the group without the receivers that are gone",
                rnd.keys.round_id,
                min(i, len(self.layouts) - 1),
                str(error)[:200],
            )
            store.set(rnd.keys.abort, b"1")  # type: ignore[arg-type]  # bytes (stub: str)
            before = rnd.group.size - 1 if rnd.group is not None else 0
            self._drop_group(linger=True)
            rnd.sent.reforms += 1
            keys = rnd.keys.reform(attempt)
            self._keep(keys.root)
            try:
                members = self._close_round(
                    store,
                    keys,
                    max(0, before - 1),
                    time.monotonic() + self.cfg.timeout_s,
                    rnd.sent,
                    window_s=self.cfg.bucket_timeout_s,
                )
                behind = [mb for mb in members if mb.have < lowest]
                members = [mb for mb in members if mb.have >= lowest]
                rnd.sent.dropped += before - len(members)
                if behind:
                    log.warning(
                        "weight sync round %d: %d receiver(s) lack buckets before %d, which are gone; "
                        "they miss this version",
                        rnd.keys.round_id,
                        len(behind),
                        lowest,
                    )
                if not members:
                    self._set_plan(store, keys, messages.RoundPlan(group="", size=1, ranks={}))
                    return False
                resume = min(mb.have for mb in members)
                rnd.keys, rnd.resume = keys, resume
                rnd.group = self._group_for(store, keys, members, rnd, resume=resume, reuse_ok=False)
                for j in range(resume, min(i + 1, len(self.layouts))):
                    self._seal(store, keys, j)
                    ws.wait_work(
                        ws.broadcast(rnd.group.pg, rnd.held[j], self.cfg.bucket_timeout_s), self.cfg.bucket_timeout_s
                    )
                return True
            except Exception as e:  # noqa: BLE001 - the re-formed group failed too: once more, then give up
                error = e
        log.warning("weight sync round %d failed after %d re-forms (%s)", rnd.keys.round_id, ws.MAX_REFORMS, error)
        self._drop_group(linger=True)
        return False

    def _pack(self, layout: ws.BucketLayout, chunk: list[torch.Tensor], i: int) -> torch.Tensor:
        """The bucket's tensors copied back to back into one flat tensor. Always a copy: under ZeRO-3
        a gathered tensor's storage may be released as soon as the next one is yielded. With a host
        copy on a GPU, the bucket is also copied to its host buffer (asynchronously)."""
        import torch

        dtype = getattr(torch, layout.dtype)
        on_host = self.device.type == "cpu"
        if on_host:
            flat = self._host[i if self.cfg.catchup else i % 2][: layout.nbytes].view(dtype)
        else:
            flat = torch.empty(layout.numel, dtype=dtype, device=self.device)
        for slot, tensor in zip(layout.slots, chunk):
            flat[slot.offset : slot.offset + slot.numel].copy_(tensor.detach().reshape(-1))
        if not on_host and self._host:
            self._host[i][: layout.nbytes].view(dtype).copy_(flat, non_blocking=True)
        self._digests[i] = ws.digest(flat.detach().reshape(-1).view(torch.uint8).cpu().numpy())
        return flat

    # ---------------------------------------------------------------------------- catch-up rounds
    def _start_catchup(self) -> None:
        if self._catchup is None:
            self._catchup = threading.Thread(target=self._catchup_loop, name="fleetrl-catchup", daemon=True)
            self._catchup.start()

    def _catchup_loop(self) -> None:
        while not self._closed.wait(CATCHUP_POLL_S):
            try:
                # every store op under the lock: the store client is not thread-safe (a publish uses it too)
                if self._store is not None and self._lock.acquire(blocking=False):
                    try:
                        self._sweep(self._store)
                        self._serve_catchup()
                    finally:
                        self._lock.release()
            except Exception:  # noqa: BLE001 - the loop must survive; the next request is served anyway
                log.exception("weight sync: a catch-up round failed")

    def _serve_catchup(self) -> None:
        """One catch-up round of the host copy for the receivers that asked since the last one (lock held)."""
        last, store = self._last, self._store
        if last is None or store is None:
            return
        version, missed = last
        ckeys = ws.CatchupKeys(missed.secret, missed.round_id)
        asked = store.add(ckeys.request, 0)
        if asked <= self._served:
            return
        if self._served < 0 or asked - self._served > ws.MAX_JOINS:  # a non-member added to the counter
            log.warning(
                "weight sync: the catch-up counter of round %d jumped to %d (a non-member wrote it); ignored",
                missed.round_id,
                asked,
            )
            self._served = asked
            return
        before, self._served = self._served, asked
        self._round += 1
        keys = ws.RoundKeys(ws.new_secret(), self._round)
        self._keep(keys.root)
        sealed = ws.auth.seal_secret(missed.secret, f"offer/{keys.round_id}", keys.secret)
        offer = messages.CatchupOffer(keys.round_id, sealed, version)
        offer.sig = self._signer.sign(ws.auth.offer_message(offer))
        store.set(ckeys.offer, messages.encode_record(offer))  # type: ignore[arg-type]  # bytes (stub: str)
        self._old_keys.append([ckeys.request, ckeys.offer])
        sent = Sent()
        members = self._close_round(store, keys, asked - before, time.monotonic() + self.cfg.timeout_s, sent)
        if members:
            self._catchup_round(store, keys, members, version)

    def _catchup_round(
        self, store: TCPStore, keys: ws.RoundKeys, members: list[messages.JoinRecord], version: int
    ) -> None:
        import torch
        from torch.distributed import PrefixStore

        ranks = {mb.identity: i for i, mb in enumerate(members, start=1)}
        plan = messages.RoundPlan(group=f"c{keys.round_id}", size=len(ranks) + 1, ranks=ranks)
        self._set_plan(store, keys, plan)
        self._keep(keys.group(plan.group))
        pg = ws.new_group(
            "gloo",
            PrefixStore(keys.group(plan.group), store),
            0,
            plan.size,
            self.cfg.bucket_timeout_s,
            self.cfg.master_addr,
        )
        try:
            for i, layout in enumerate(self.layouts):
                flat = self._host[i][: layout.nbytes].view(getattr(torch, layout.dtype))
                self._seal(store, keys, i)
                ws.wait_work(ws.broadcast(pg, flat, self.cfg.bucket_timeout_s), self.cfg.bucket_timeout_s)
            log.info(
                "weight sync: catch-up round %d sent version %d to %d receiver(s)", keys.round_id, version, len(ranks)
            )
        finally:
            ws.retire_group(pg, 2 * self.cfg.bucket_timeout_s)

    # ------------------------------------------------------------------------------------ close
    def _drop_group(self, linger: bool = False) -> None:
        if self._group is not None:
            if linger:
                ws.retire_group(self._group.pg, 2 * self.cfg.bucket_timeout_s)
            else:
                ws.release_group(self._group.pg)
            self._group = None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._drop_group()
            self._store = None
            self._host = []
