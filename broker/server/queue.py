"""What the broker holds: every live group, the queue of groups ready for learners, the ids it has
seen (de-duplication), and the version ranges a rollback discarded. No spool, no clock.

``GroupQueue.grew`` turns true whenever a group becomes ready; the server wakes waiting long polls
on it instead of re-running them on a timer.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque

from fleetrl.common import messages as m

DEDUPE_WINDOW = 1 << 20  # acknowledged group ids remembered for de-duplication


class GroupQueue:
    def __init__(self):
        self.groups: dict[str, m.SampleGroup] = {}  # every live group, queued or not
        self.queue: deque[str] = deque()  # ids ready for learners, oldest first (may hold removed ids)
        self.queued: set[str] = set()
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.grew = False

    def __len__(self) -> int:
        return len(self.queued)

    def knows(self, gid: str) -> bool:
        return gid in self.seen or gid in self.groups

    def remember(self, gid: str) -> None:
        self.seen[gid] = None
        if len(self.seen) > DEDUPE_WINDOW:
            self.seen.popitem(last=False)

    def enqueue(self, gid: str, front: bool = False) -> None:
        if gid in self.queued:
            return
        (self.queue.appendleft if front else self.queue.append)(gid)
        self.queued.add(gid)
        self.grew = True

    def requeue_front(self, gids: list[str]) -> int:
        """Put live ``gids`` back at the front, in their order; returns how many."""
        live = [g for g in gids if g in self.groups]
        for gid in reversed(live):
            self.enqueue(gid, front=True)
        return len(live)

    def dequeue(self) -> str | None:
        while self.queue:
            gid = self.queue.popleft()
            if gid in self.queued:
                self.queued.discard(gid)
                return gid
        return None

    def take_queued(self, gids: list[str]) -> list[str]:
        """Remove those of ``gids`` that are queued (a late ack takes them back); returns them."""
        taken = [g for g in gids if g in self.queued]
        for gid in taken:
            self.queued.discard(gid)
        return taken

    def forget(self, gids: list[str]) -> list[m.SampleGroup]:
        """Drop groups for good; returns those that were live."""
        out = []
        for gid in gids:
            self.queued.discard(gid)
            g = self.groups.pop(gid, None)
            if g is not None:
                out.append(g)
        return out


class VersionRanges:
    """Closed, merged ranges of policy versions (those a rollback discarded); membership in O(log n)."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None):
        self.lo: list[int] = []
        self.hi: list[int] = []
        for lo, hi in ranges or []:
            self.add(lo, hi)

    def add(self, lo: int, hi: int) -> None:
        """Add ``[lo, hi]``, merging it with every range it overlaps or touches."""
        i = bisect.bisect_left(self.hi, lo - 1)  # first range that ends at or after lo - 1
        j = bisect.bisect_right(self.lo, hi + 1)  # ranges before j start at or before hi + 1
        if i < j:
            lo, hi = min(lo, self.lo[i]), max(hi, self.hi[j - 1])
        self.lo[i:j], self.hi[i:j] = [lo], [hi]

    def __contains__(self, version: int) -> bool:
        i = bisect.bisect_right(self.lo, version) - 1
        return i >= 0 and version <= self.hi[i]

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether any version in ``[lo, hi]`` is in a range."""
        i = bisect.bisect_left(self.hi, lo)  # first range that ends at or after lo
        return i < len(self.lo) and self.lo[i] <= hi

    def touches(self, group: m.SampleGroup) -> bool:
        """Whether any token of ``group`` was sampled by a version in a range (not only its oldest, its
        ``policy_version``: with in-flight updates a group started on a healthy version can finish on a
        rolled-back one)."""
        if not self.lo:
            return False
        if not len(group.token_versions):
            return group.policy_version in self
        return self.overlaps(group.policy_version, int(group.version_array().max()))

    def __len__(self) -> int:
        return len(self.lo)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.lo, self.hi))
