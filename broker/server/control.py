"""Policy versions and controls: what ``PublishVersion`` and ``Control`` do to the broker.

- **Versions.** A learner publishes a version with the weights' whereabouts. The broker refuses a
  negative one, one that jumps more than ``broker.max_version_jump`` past the current version (once a
  version is known: recovered from the spool or published since start) and one whose ``published_at``
  lies more than ``sync.max_clock_skew_s`` in the future; it then stamps ``published_at`` with its
  own clock (never going back), which is what rollouts order versions by, and announces it.
- **Pause.** An operator's pause holds until an operator resumes. A learner's pause (its rollback)
  is a *hold* of that learner: it lifts its own hold, and a dead learner's hold lifts by itself after
  ``broker.client_timeout_s``. The broker is paused while any pause or hold stands.
- **Stop** (operator): rollouts are told to finish; ``resume`` by an operator undoes it.
- **Discard**: a closed range ``[min_version, max_version]`` (empty when min > max) of published versions
  (``max_version`` at most the current version: a discard cannot mark versions not yet published, so
  it never makes every later group stale); queued groups with any token sampled by those versions (not
  only their oldest, ``policy_version``) are dropped and their prompts re-issued, and the range is kept
  (merged with the others, spooled) so late arrivals that touch it are dropped too.
- **Pause with discard** (operator): a range an operator discards while its pause stands is lifted by
  the operator's ``resume`` (the dropped groups stay dropped; later arrivals from those versions are
  taken again). A range discarded outside an operator pause, and a learner's rollback discard, stay.
  A broker restart during the pause ends the pause (it is not spooled): the ranges stay then.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from fleetrl.broker.server import spool as sp
from fleetrl.broker.server.journal import Journal
from fleetrl.broker.server.queue import GroupQueue, VersionRanges
from fleetrl.broker.server.staleness import MeasuredCapacity
from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig

# drop(group ids, counter, requeue their prompts, records spooled in the same write): BrokerState.drop
Drop = Callable[[list[str], str, bool, list[sp.Record]], None]

log = logging.getLogger("fleetrl.broker.server.state")
SECRET_ROLES = (None, "rollout")  # who is given a broadcast round's secret (None: a trusted in-process caller)


class Controls:
    """Versions, pauses, stops and discards: the queue (what a discard drops), the journal, the announcements."""

    def __init__(
        self,
        cfg: JobConfig,
        q: GroupQueue,
        journal: Journal,
        drop: Drop,
        announcements: list[tuple[bytes, m.Message]],
        measured: MeasuredCapacity | None,
        counters: Counter[str],
        rejected: Counter[str],
        wall: Callable[[], float],
    ):
        self.bcfg, self.max_clock_skew_s = cfg.broker, cfg.sync.max_clock_skew_s
        self.q, self.journal, self.drop, self.announcements = q, journal, drop, announcements
        self.measured, self.counters, self.rejected, self.wall = measured, counters, rejected, wall
        self.version, self.version_step, self.weights = 0, 0, m.WeightsInfo()
        self.version_known = False
        self.operator_paused = False
        self.pause_holds: dict[str, str] = {}  # learner client id -> reason of its rollback pause
        self.stopping = False
        self.discarded = VersionRanges()
        self.kept_discards = VersionRanges()  # the ranges an operator's resume does not lift (all but `provisional`)
        self.provisional = 0  # ranges an operator discarded during its pause: lifted by its resume

    @property
    def paused(self) -> bool:
        return self.operator_paused or bool(self.pause_holds)

    def weights_for(self, role: str | None) -> m.WeightsInfo:
        """The current WeightsInfo; the round secret only for rollouts."""
        if role in SECRET_ROLES or not self.weights.secret:
            return self.weights
        return m.WeightsInfo(**{f: getattr(self.weights, f) for f in m.WeightsInfo.__struct_fields__ if f != "secret"})

    def version_record(self) -> sp.VersionSet:
        return sp.VersionSet(self.version, self.version_step, self.weights)

    def restore(self, rec: sp.Recovered) -> None:
        if rec.version is not None:
            self.version, self.version_step, self.weights = rec.version.version, rec.version.step, rec.version.weights
            self.version_known = True
        for lo, hi in rec.discarded:  # -1: an open range from an older broker, closed at the recovered version
            self.discarded.add(lo, self.version if hi < 0 else hi)
            self.kept_discards.add(lo, self.version if hi < 0 else hi)

    # ----------------------------------------------------------------------------- versions
    def publish(self, req: m.PublishVersion) -> m.Message:
        problem = self._check_publish(req)
        if problem:
            self.rejected["bad_version"] += 1
            return m.Error(req_id=req.req_id, code="bad_request", reason=problem)
        stamped = max(self.wall(), self.weights.published_at + 1e-6)
        weights = m.WeightsInfo(
            **{**{f: getattr(req.weights, f) for f in m.WeightsInfo.__struct_fields__}, "published_at": stamped}
        )
        self.journal.write([sp.VersionSet(req.version, req.step, weights)])
        if req.version < self.version:
            self.counters["version_rewinds"] += 1
            log.warning(
                "policy version goes back from %d to %d (learner resumed or rolled back)", self.version, req.version
            )
        self.version, self.version_step, self.weights, self.version_known = req.version, req.step, weights, True
        if self.measured is not None:
            self.measured.published(req.version)
        self.announcements.append(
            (m.TOPIC_VERSION, m.VersionAnnouncement(version=req.version, step=req.step, weights=weights))
        )
        return m.Ack(req_id=req.req_id, ref=str(req.version))

    def _check_publish(self, req: m.PublishVersion) -> str | None:
        if not 0 <= req.version <= m.MAX_POLICY_VERSION:
            return f"policy version {req.version} is outside [0, {m.MAX_POLICY_VERSION}]"
        if self.version_known and req.version > self.version + self.bcfg.max_version_jump:
            return (
                f"policy version {req.version} jumps more than broker.max_version_jump={self.bcfg.max_version_jump} "
                f"past the current version {self.version}"
            )
        skew = self.max_clock_skew_s
        if req.weights.published_at > self.wall() + skew:
            return (
                f"published_at {req.weights.published_at:.0f} lies more than sync.max_clock_skew_s={skew:g} s in "
                "the broker's future; fix the learner machine's clock"
            )
        return None

    # ----------------------------------------------------------------------------- control
    def control(self, req: m.Control, role: str | None) -> m.Message:
        """Apply one Control (``role`` None: a trusted caller, treated as an operator)."""
        count = 0
        if req.action == "discard":
            if req.min_version < 0 or req.max_version < 0:
                return m.Error(
                    req_id=req.req_id,
                    code="bad_request",
                    reason=(
                        f"discard takes a closed range of versions [min_version, max_version], both >= 0 (there is no "
                        f"open end any more); got [{req.min_version}, {req.max_version}]"
                    ),
                )
            if req.min_version <= req.max_version and req.max_version > self.version:
                return m.Error(
                    req_id=req.req_id,
                    code="bad_request",
                    reason=(
                        f"discard covers only published versions: max_version {req.max_version} is past the current "
                        f"version {self.version}; give --max-version {self.version} or less"
                    ),
                )
            if req.min_version <= req.max_version:  # min > max: an empty range (a rollback to the current version)
                count = self._discard(
                    req.min_version, req.max_version, provisional=role == "operator" and self.operator_paused
                )
        elif role == "learner":
            self._learner_hold(req)
        elif req.action == "pause":
            self.operator_paused = True
        elif req.action == "resume":
            if self.operator_paused and self.provisional:
                self._lift_provisional()
            self.operator_paused, self.stopping = False, False
            self.pause_holds.clear()
        elif req.action == "stop":
            self.stopping = True
        self.announcements.append(
            (
                m.TOPIC_CONTROL,
                m.ControlAnnouncement(
                    action=req.action, reason=req.reason, min_version=req.min_version, max_version=req.max_version
                ),
            )
        )
        log.info(
            "control %s from %s (%s)%s",
            req.action,
            req.client_id,
            req.reason,
            f": {count} groups discarded" if count else "",
        )
        return m.Ack(req_id=req.req_id, ref=req.action, count=count)

    def _learner_hold(self, req: m.Control) -> None:
        if req.action == "pause":
            self.pause_holds[req.client_id] = req.reason
        else:  # resume: only its own hold
            self.pause_holds.pop(req.client_id, None)

    def _discard(self, lo: int, hi: int, provisional: bool = False) -> int:
        doomed_range = VersionRanges([(lo, hi)])  # any token from [lo, hi], not only the oldest
        doomed = [gid for gid in self.q.queue if gid in self.q.queued and doomed_range.touches(self.q.groups[gid])]
        self.drop(doomed, "discarded", True, [sp.VersionsDiscarded(lo, hi)])
        self.discarded.add(lo, hi)
        if provisional:
            self.provisional += 1
        else:
            self.kept_discards.add(lo, hi)
        return len(doomed)

    def _lift_provisional(self) -> None:
        """An operator's resume: the ranges discarded during its pause are lifted (spooled as the set that stays)."""
        kept = self.kept_discards.ranges()
        self.journal.write([sp.DiscardsSet(kept)])
        log.warning(
            "resume lifts the %d version range(s) discarded during the operator's pause; still discarded: %s",
            self.provisional,
            kept or "none",
        )
        self.discarded, self.provisional = VersionRanges(kept), 0

    def lift_dead_holds(self, dead: set[str]) -> None:
        for cid in [c for c in self.pause_holds if c in dead]:
            log.warning("learner %s died during its rollback pause; lifting its hold", cid)
            del self.pause_holds[cid]
