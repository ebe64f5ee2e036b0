"""Group ingest: judge every pushed group, write what is kept to the spool, then apply it.

A push is handled in three passes so that nothing is acknowledged before it is durable and a failed
spool write leaves no trace:

1. **judge** each group without changing anything: ``duplicate`` (already held or seen), ``rejected``
   (fails ``check_group``: tokens, log-probs, versions from the future, an unleased prompt; is
   implausible (``plausible.py``: rewards outside the job's range, log-probs of exactly 0.0), counted
   against the client; or its prompt already had ``rollout.group_size`` samples for each time it was
   handed out), ``throttled`` (the broker holds ``broker.max_held_groups`` groups or
   ``broker.max_held_bytes`` bytes, or an unleased push over capacity), else ``accepted`` — or
   ``stale`` when its version is too old or was discarded by a rollback;
2. **write** the records of every group that is kept (accepted, or stale: remembered for de-duplication)
   in one spool write; a group that cannot even be encoded is rejected on its own;
3. **apply**: queue the accepted groups, drop the stale ones (re-issuing their prompts). Accepted groups
   that are less than half of what their frame held are copied out of it (``messages.detached``), so
   the refused rest of the frame is freed.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetrl.broker import spool as sp
from fleetrl.broker.clients import ClientState
from fleetrl.broker.staleness import min_fresh_version
from fleetrl.common import messages as m

if TYPE_CHECKING:
    from fleetrl.broker.state import BrokerState


class Rate:
    """Events per second over a sliding window of one-second buckets."""

    def __init__(self, window_s: int = 10):
        self.window_s = window_s
        self.buckets: deque[list[float]] = deque()

    def add(self, now: float, n: int = 1) -> None:
        sec = int(now)
        if self.buckets and self.buckets[-1][0] == sec:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([sec, n])
        while self.buckets and self.buckets[0][0] <= sec - self.window_s:
            self.buckets.popleft()

    def per_s(self, now: float) -> float:
        horizon = int(now) - self.window_s
        return sum(n for s, n in self.buckets if s > horizon) / self.window_s


@dataclass
class Verdict:
    group: m.SampleGroup
    status: str  # accepted | duplicate | stale | rejected | throttled
    reason: str = ""
    drop: str = ""  # stale: the counter it is dropped under (dropped_stale | discarded)
    code: str = ""  # rejected: implausible_reward | implausible_logprob (counted against the client)
    nbytes: int = 0  # accepted: what it counts against broker.max_held_bytes


class Ingest:
    def __init__(self, state: "BrokerState"):
        self.s = state
        self.rate_in = Rate()

    def push(self, groups: list[m.SampleGroup], client: ClientState, now: float) -> list[tuple[str, str, str]]:
        """(status, reason, code) for each group, in order (see the module docstring); raises SpoolUnavailable."""
        verdicts = self._judge(groups)
        self._detach_if_sparse(verdicts)
        kept = [v for v in verdicts if v.status in ("accepted", "stale")]
        try:
            if self.s.spool is not None:
                self.s._log(self._records(kept))
        except ValueError:  # some group cannot be encoded: find it, write the others one by one
            for v in kept:
                try:
                    self.s._log(self._records([v]))
                except ValueError as e:
                    v.status, v.reason = "rejected", f"group {v.group.group_id}: {e}"
                    self.s.rejected["invalid_group"] += 1
        for v in verdicts:
            if v.status in ("accepted", "stale"):
                self._apply(v, client, now)
            elif v.status == "duplicate":
                self.s.counters["duplicates"] += 1
            elif v.status == "throttled":
                self.s.counters["push_throttled"] += 1
            elif v.code:
                kind = "implausible/" + v.code.split("_", 1)[1]
                self.s.counters[kind] += 1
                self.s.clients.tally(client.client_id, kind)
        return [(v.status, v.reason, v.code) for v in verdicts]

    @staticmethod
    def _detach_if_sparse(verdicts: list[Verdict]) -> None:
        """Copy the accepted groups out of their frame when they are less than half of it."""
        kept = [v for v in verdicts if v.status == "accepted"]
        if len(kept) == len(verdicts):  # every group of the frame is held (the common case)
            return
        if kept and 2 * sum(m.arrays_nbytes(v.group) for v in kept) < sum(m.arrays_nbytes(v.group) for v in verdicts):
            for v in kept:
                v.group = m.detached(v.group)

    def _judge(self, groups: list[m.SampleGroup]) -> list[Verdict]:
        s, bcfg = self.s, self.s.bcfg
        max_version = s.version + bcfg.version_slack if s.controls.version_known else None
        oldest = min_fresh_version(s.version, bcfg.max_staleness)
        held, held_bytes, load, seen = len(s.q.groups), s.q.held_bytes, s.load(), set()
        group_size, answering = s.cfg.rollout.group_size, Counter()  # samples per prompt id in this frame
        out = []
        for g in groups:
            if s.q.knows(g.group_id) or g.group_id in seen:
                out.append(Verdict(g, "duplicate"))
                continue
            problem = m.check_group(g, s.vocab_size, max_version=max_version)
            leased = s.prompts.known(g.prompt_id)
            if problem is None and not leased and not bcfg.accept_unleased:
                problem = (f"group {g.group_id} answers prompt {g.prompt_id!r}, which this broker never leased; "
                           "push groups for leased prompts (or set broker.accept_unleased=true for imports)")
            code = ""
            if problem is None:
                code, problem = s.plausibility.check(g) or ("", None)
            if problem:
                s.rejected["invalid_group"] += 1
                out.append(Verdict(g, "rejected", problem, code=code))
                continue
            n = len(g.rewards)
            if leased and not s.prompts.room(g.prompt_id, answering[g.prompt_id] + n, group_size):
                s.rejected["prompt_overanswered"] += 1
                out.append(Verdict(g, "rejected", (
                    f"group {g.group_id}: prompt {g.prompt_id!r} has had its {group_size} samples (rollout.group_size) "
                    "for each time it was handed out; push one group per leased prompt")))
                continue
            nbytes = m.group_nbytes(g)
            if held >= s.max_held or (not leased and load >= s.capacity):
                out.append(Verdict(g, "throttled", f"the broker holds {held} groups (capacity {s.capacity}, at most "
                                                   f"broker.max_held_groups={s.max_held}); push again later"))
                continue
            if held_bytes and held_bytes + nbytes > s.max_held_bytes:
                out.append(Verdict(g, "throttled", f"the broker holds {held_bytes} bytes of groups and this one counts "
                                                   f"{nbytes} (broker.max_held_bytes={s.max_held_bytes}); push again later"))
                continue
            seen.add(g.group_id)
            if s.controls.discarded.touches(g):
                out.append(Verdict(g, "stale", f"policy versions of group {g.group_id} (oldest {g.policy_version}) "
                                               "were rolled back by the learner",
                                   "discarded"))
            elif g.policy_version < oldest:
                out.append(Verdict(g, "stale", f"policy version {g.policy_version} is older than {oldest}",
                                   "dropped_stale"))
            else:
                out.append(Verdict(g, "accepted", nbytes=nbytes))
                held, held_bytes, load = held + 1, held_bytes + nbytes, load + (0 if leased else 1)
            answering[g.prompt_id] += n
        return out

    def _records(self, kept: list[Verdict]) -> list[sp.Record]:
        recs: list[sp.Record] = []
        for v in kept:
            recs.append(sp.GroupAccepted(v.group))
            if v.status == "stale":
                recs.append(sp.GroupsDone([v.group.group_id]))
                p = self._requeued_prompt(v)
                if p is not None:
                    recs.append(sp.PromptsRequeued([p]))
        return recs

    def _requeued_prompt(self, v: Verdict) -> m.Prompt | None:
        requeue = v.drop == "discarded" or self.s.bcfg.requeue_stale
        return self.s.prompts.lookup(v.group.prompt_id) if requeue else None

    def _apply(self, v: Verdict, client: ClientState, now: float) -> None:
        s, g = self.s, v.group
        s.prompts.fulfil(g.prompt_id)
        s.prompts.answered(g.prompt_id, len(g.rewards))
        s.q.remember(g.group_id)
        s.counters["groups_in"] += 1
        client.groups_pushed += 1
        self.rate_in.add(now)
        if v.status == "accepted":
            s.q.hold(g, v.nbytes)
            s.q.enqueue(g.group_id)
            return
        s.counters[v.drop] += 1
        p = self._requeued_prompt(v)
        if p is not None:
            s.prompts.requeue(p)
