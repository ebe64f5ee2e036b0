"""The broker's prompt set: loading, the epoch cursor, leases to rollout servers, and re-issue.

Prompts are served in a per-epoch order (shuffled with ``seed + epoch`` when enabled). A prompt goes
out under a lease; it is *fulfilled* when a group for it arrives. Prompts whose lease expires (the
server died), whose group was dropped as stale, or which a server hands back, go to a re-issue queue
that is served before new prompts — so no prompt is lost.
"""

from __future__ import annotations

import random
import uuid
from collections import OrderedDict, deque
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

from fleetrl.common.data.tables import DataError
from fleetrl.common.messages import Prompt

RECENT = 1 << 18  # prompt ids remembered as handed out (groups for others are refused unless broker.accept_unleased)


def rows_to_prompts(rows: list[dict[str, Any]], prompt_key: str, answer_key: str, source: str) -> list[Prompt]:
    """Validate rows once; the returned prompts carry ``prompt_id`` = "<row>" (epoch added on lease)."""
    if not rows:
        raise DataError(f"{source}: the prompt set is empty")
    if prompt_key not in rows[0]:
        raise DataError(
            f"{source}: rows have no {prompt_key!r} column (columns: {sorted(rows[0])}); set data.prompt_key"
        )
    out = []
    for i, row in enumerate(rows):
        text = row.get(prompt_key)
        if not isinstance(text, (str, list)) or not text:
            raise DataError(
                f"{source}: row {i} has no usable {prompt_key!r} (a non-empty string or a list of messages); "
                "fix the row, set data.prompt_key, or leave such rows out with a data.map hook"
            )
        answer = row.get(answer_key)
        metadata = {k: v for k, v in row.items() if k != prompt_key}  # the answer's column too: batched rewards read it
        out.append(
            Prompt(prompt_id=str(i), prompt=text, answer=None if answer is None else str(answer), metadata=metadata)
        )
    return out


@dataclass
class PromptLeaseState:
    lease_id: str
    client_id: str
    expires_at: float
    prompts: dict[str, Prompt] = field(default_factory=dict)  # prompt_id -> prompt, still open


class PromptSource:
    """Cursor over epochs + open leases + the re-issue queue."""

    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int, epochs: int):
        self.base = prompts
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order(0)
        self.reissue: deque[Prompt] = deque()
        self.leases: dict[str, PromptLeaseState] = {}
        self.lease_of: dict[str, str] = {}  # open prompt_id -> lease_id
        self.recent: OrderedDict[str, None] = OrderedDict()  # prompt ids leased or re-issued lately (known ones)
        self.tally: OrderedDict[str, list[int]] = OrderedDict()  # prompt id -> [times handed out, samples accepted]
        self.reissued_total = 0
        self._taken_reissued = 0

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.base)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def seek(self, epoch: int, pos: int) -> None:
        """Restore the cursor (spool replay, resume)."""
        self.epoch, self.pos = epoch, pos
        self._order = self._epoch_order(epoch)

    @property
    def exhausted(self) -> bool:
        return self.epoch >= self.epochs and not self.reissue

    @property
    def leased(self) -> int:
        return len(self.lease_of)

    def lookup(self, prompt_id: str) -> Prompt | None:
        """The prompt behind an id "<epoch>:<row>" (None for ids of another prompt set)."""
        epoch, _, row = prompt_id.partition(":")
        if not (epoch.isdigit() and row.isdigit()) or int(row) >= len(self.base):
            return None
        base = self.base[int(row)]
        return Prompt(prompt_id=prompt_id, prompt=base.prompt, answer=base.answer, metadata=base.metadata)

    def _next_new(self) -> Prompt | None:
        if self.pos >= len(self._order):
            if self.epoch + 1 >= self.epochs:
                self.epoch, self.pos = self.epochs, 0
                return None
            self.seek(self.epoch + 1, 0)
        if self.epoch >= self.epochs:
            return None
        row = self._order[self.pos]
        self.pos += 1
        return self.lookup(f"{self.epoch}:{row}")

    def known(self, prompt_id: str) -> bool:
        """Whether a group for ``prompt_id`` answers something this broker handed out (open, waiting for
        re-issue, or leased lately)."""
        return prompt_id in self.lease_of or prompt_id in self.recent

    def _note(self, prompt_id: str) -> None:
        self.recent[prompt_id] = None
        self.recent.move_to_end(prompt_id)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)

    def mark(self) -> tuple[int, int]:
        """The cursor before a ``take`` (see ``untake``)."""
        return self.epoch, self.pos

    def untake(self, mark: tuple[int, int], taken: list[Prompt]) -> None:
        """Undo the last ``take`` (its lease could not be spooled): the same prompts come out next time."""
        for p in reversed(taken[: self._taken_reissued]):
            self.reissue.appendleft(p)
        if (self.epoch, self.pos) != mark:
            self.seek(*mark)

    def take(self, n: int) -> list[Prompt]:
        """Up to ``n`` prompts: re-issued ones first, then new ones from the cursor."""
        out: list[Prompt] = []
        while len(out) < n and self.reissue:
            p = self.reissue.popleft()
            if p.prompt_id not in self.lease_of:
                out.append(p)
        self._taken_reissued = len(out)
        while len(out) < n:
            new = self._next_new()
            if new is None:
                break
            out.append(new)
        return out

    def open_lease(self, client_id: str, prompts: list[Prompt], now: float, lease_s: float) -> PromptLeaseState:
        lease = PromptLeaseState(uuid.uuid4().hex[:16], client_id, now + lease_s, {p.prompt_id: p for p in prompts})
        self.leases[lease.lease_id] = lease
        for p in prompts:
            self.lease_of[p.prompt_id] = lease.lease_id
            self._note(p.prompt_id)
            self._tally(p.prompt_id)[0] += 1
        return lease

    def _tally(self, prompt_id: str) -> list[int]:
        rec = self.tally.setdefault(prompt_id, [0, 0])
        self.tally.move_to_end(prompt_id)
        while len(self.tally) > RECENT:
            self.tally.popitem(last=False)
        return rec

    def room(self, prompt_id: str, samples: int, group_size: int) -> bool:
        """Whether ``samples`` more samples for a known prompt fit its bound: ``group_size`` per hand-out
        (a re-issued prompt may be answered by its first holder and by the next; one key pushing
        10,000 groups for one leased prompt id may not)."""
        handed, accepted = self.tally.get(prompt_id, (0, 0))
        return accepted + samples <= max(1, handed) * group_size

    def answered(self, prompt_id: str, samples: int) -> None:
        if prompt_id in self.tally:  # handed out by this broker (imports under accept_unleased are not bounded here)
            self.tally[prompt_id][1] += samples

    def fulfil(self, prompt_id: str) -> bool:
        """A group for ``prompt_id`` arrived: close it in its lease. False if it was not open."""
        lease_id = self.lease_of.pop(prompt_id, None)
        if lease_id is None:
            return False
        lease = self.leases[lease_id]
        lease.prompts.pop(prompt_id, None)
        if not lease.prompts:
            del self.leases[lease_id]
        return True

    def give_back(self, lease_id: str, prompt_ids: list[str] | None = None) -> int:
        """Re-issue open prompts of a lease (all when ``prompt_ids`` is empty/None)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return 0
        ids = list(lease.prompts) if not prompt_ids else [i for i in dict.fromkeys(prompt_ids) if i in lease.prompts]
        for pid in ids:
            self.requeue(lease.prompts.pop(pid))
            self.lease_of.pop(pid, None)
        if not lease.prompts:
            del self.leases[lease_id]
        return len(ids)

    def requeue(self, prompt: Prompt) -> None:
        self.reissue.append(prompt)
        self._note(prompt.prompt_id)
        self.reissued_total += 1

    def expire(self, now: float, dead_clients: Set[str] = frozenset()) -> int:
        """Re-issue the prompts of expired leases and of leases held by dead clients."""
        expired = [
            lid for lid, lease in self.leases.items() if lease.expires_at <= now or lease.client_id in dead_clients
        ]
        return sum(self.give_back(lid) for lid in expired)
