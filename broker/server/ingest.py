"""Group ingest: judge every pushed group, write what is kept to the spool, then apply it.

A push is handled in three passes so that nothing is acknowledged before it is durable and a failed
spool write leaves no trace:

1. **judge** each group without changing anything: ``duplicate`` (already held or seen), ``rejected``
   (fails ``check_group``: tokens, log-probs, rewards, versions from the future, an unleased prompt; or
   its prompt already had ``rollout.group_size`` samples for each time it was handed out),
   ``throttled`` (the broker holds ``broker.max_held_groups``, or an unleased push over capacity),
   else ``accepted`` — or ``stale`` when its version is too old or was discarded by a rollback;
2. **write** the records of every group that is kept (accepted, or stale: remembered for de-duplication)
   in one spool write; a group that cannot even be encoded is rejected on its own;
3. **apply**: queue the accepted groups, drop the stale ones (re-issuing their prompts).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fleetrl.broker.server import spool as sp
from fleetrl.broker.server.admission import Admission
from fleetrl.broker.server.client_table import ClientState
from fleetrl.broker.server.control import Controls
from fleetrl.broker.server.journal import Journal
from fleetrl.broker.server.prompts import PromptSource
from fleetrl.broker.server.queue import GroupQueue
from fleetrl.broker.server.rates import Rate
from fleetrl.broker.server.staleness import min_fresh_version
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig


@dataclass
class Verdict:
    group: m.SampleGroup
    status: str  # accepted | duplicate | stale | rejected | throttled
    reason: str = ""
    drop: str = ""  # stale: the counter it is dropped under (dropped_stale | discarded)


class Ingest:
    """Pushed groups in: the queue, the prompt leases they answer, the journal, admission and the versions."""

    def __init__(
        self,
        cfg: JobConfig,
        vocab_size: int,
        q: GroupQueue,
        prompts: PromptSource,
        journal: Journal,
        admission: Admission,
        controls: Controls,
        counters: Counter[str],
        rejected: Counter[str],
    ):
        self.bcfg, self.group_size, self.vocab_size = cfg.broker, cfg.rollout.group_size, vocab_size
        self.q, self.prompts, self.journal, self.admission, self.controls = q, prompts, journal, admission, controls
        self.counters, self.rejected = counters, rejected
        self.rate_in = Rate()

    def push(self, groups: list[m.SampleGroup], client: ClientState, now: float) -> list[tuple[str, str]]:
        """(status, reason) for each group, in order (see the module docstring); raises SpoolUnavailable."""
        verdicts = self._judge(groups)
        kept = [v for v in verdicts if v.status in ("accepted", "stale")]
        try:
            if self.journal.enabled:
                self.journal.write(self._records(kept))
        except ValueError:  # some group cannot be encoded: find it, write the others one by one
            for v in kept:
                try:
                    self.journal.write(self._records([v]))
                except ValueError as e:
                    v.status, v.reason = "rejected", f"group {v.group.group_id}: {e}"
                    self.rejected["invalid_group"] += 1
        for v in verdicts:
            if v.status in ("accepted", "stale"):
                self._apply(v, client, now)
            elif v.status == "duplicate":
                self.counters["duplicates"] += 1
            elif v.status == "throttled":
                self.counters["push_throttled"] += 1
        return [(v.status, v.reason) for v in verdicts]

    def _judge(self, groups: list[m.SampleGroup]) -> list[Verdict]:
        bcfg, version, adm = self.bcfg, self.controls.version, self.admission
        max_version = version + bcfg.version_slack if self.controls.version_known else None
        oldest = min_fresh_version(version, bcfg.max_staleness)
        held, load, seen = len(self.q.groups), adm.load(), set()
        group_size, answering = self.group_size, Counter[str]()  # samples per prompt id in this frame
        out = []
        for g in groups:
            if self.q.knows(g.group_id) or g.group_id in seen:
                out.append(Verdict(g, "duplicate"))
                continue
            problem = m.check_group(g, self.vocab_size, max_abs_reward=bcfg.max_abs_reward, max_version=max_version)
            leased = self.prompts.known(g.prompt_id)
            if problem is None and not leased and not bcfg.accept_unleased:
                problem = (
                    f"group {g.group_id} answers prompt {g.prompt_id!r}, which this broker never leased; "
                    "push groups for leased prompts (or set broker.accept_unleased=true for imports)"
                )
            if problem:
                self.rejected["invalid_group"] += 1
                out.append(Verdict(g, "rejected", problem))
                continue
            n = len(g.rewards)
            if leased and not self.prompts.room(g.prompt_id, answering[g.prompt_id] + n, group_size):
                self.rejected["prompt_overanswered"] += 1
                out.append(
                    Verdict(
                        g,
                        "rejected",
                        (
                            f"group {g.group_id}: prompt {g.prompt_id!r} has had its {group_size} samples (rollout.group_size) "
                            "for each time it was handed out; push one group per leased prompt"
                        ),
                    )
                )
                continue
            if held >= adm.max_held or (not leased and load >= adm.capacity):
                out.append(
                    Verdict(
                        g,
                        "throttled",
                        f"the broker holds {held} groups (capacity {adm.capacity}, at most "
                        f"broker.max_held_groups={adm.max_held}); push again later",
                    )
                )
                continue
            seen.add(g.group_id)
            if self.controls.discarded.touches(g):
                out.append(
                    Verdict(
                        g,
                        "stale",
                        f"policy versions of group {g.group_id} (oldest {g.policy_version}) "
                        "were rolled back by the learner",
                        "discarded",
                    )
                )
            elif g.policy_version < oldest:
                out.append(
                    Verdict(g, "stale", f"policy version {g.policy_version} is older than {oldest}", "dropped_stale")
                )
            else:
                out.append(Verdict(g, "accepted"))
                held, load = held + 1, load + (0 if leased else 1)
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
        requeue = v.drop == "discarded" or self.bcfg.requeue_stale
        return self.prompts.lookup(v.group.prompt_id) if requeue else None

    def _apply(self, v: Verdict, client: ClientState, now: float) -> None:
        g = v.group
        self.prompts.fulfil(g.prompt_id)
        self.prompts.answered(g.prompt_id, len(g.rewards))
        self.q.remember(g.group_id)
        self.counters["groups_in"] += 1
        client.groups_pushed += 1
        self.rate_in.add(now)
        if v.status == "accepted":
            self.q.groups[g.group_id] = g
            self.q.enqueue(g.group_id)
            return
        self.counters[v.drop] += 1
        p = self._requeued_prompt(v)
        if p is not None:
            self.prompts.requeue(p)
