"""The learner's health monitor: rules from ``health.rules`` judge every step's metrics and decide.

Pure decision logic (no torch, no sockets); the training loop acts on what it returns::

    monitor = HealthMonitor(cfg.health, run_dir / "events.jsonl")
    events = monitor.observe(step, stats)          # rules that fired this step (logged, in events.jsonl)
    action = monitor.decide(events)                # none | alert | rollback | stop
    healthy = monitor.on_checkpoint(step)          # tag for the checkpoint saved at `step`
    # rollback: target = monitor.rollback_target(steps); restore; lr *= lr_factor;
    #           monitor.record_rollback(target, step); monitor.reset_after_rollback(target)

A rule *fires* at every evaluation its condition holds. That counts against the healthy tag of nearby
checkpoints; an event is emitted when the condition starts and again every ``window`` evaluations while
it lasts (so a persisting alert does not flood the log). Event ``value``/``threshold`` are in the
units of ``metric``: the observed value (or moving average) and the limit it crossed. Rule semantics
and defaults: docs/monitoring.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fleetrl.common.config.learner import HealthConfig
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.learner.health_hacking import RewardHacking  # noqa: F401 (registers reward_hacking)
from fleetrl.learner.health_rules import HEALTH_RULES, Fired, HealthEvent, Rule
from fleetrl.learner.health_servers import ServerRule  # registers the per-server rules

__all__ = ["HEALTH_RULES", "HealthEvent", "HealthMonitor"]

log = logging.getLogger("fleetrl.learner.health")

ACTION_RANK = {"none": 0, "alert": 1, "rollback": 2, "stop": 3}
MISSING_METRIC_WARN_STEPS = 20
"""A rule whose metric is absent this many steps in a row gets one warning (a typo, or a feature off)."""


class HealthMonitor:
    def __init__(self, cfg: HealthConfig, events_path: Path | None = None):
        self.cfg, self.events_path = cfg, Path(events_path) if events_path is not None else None
        self.rules: list[Rule] = []
        for i, spec in enumerate(cfg.rules if cfg.enabled else []):
            try:
                cls = HEALTH_RULES[spec.name]
            except RegistryError as e:
                raise RegistryError(f"health.rules[{i}].name: {e}") from None
            self.rules.append(cls(spec, f"health.rules[{i}]"))
        self.events: list[HealthEvent] = []
        self.rollbacks_done = 0
        self.last_rollback: int | None = None  # the step the newest rollback left (health.rollback_cooldown_steps)
        self.stop_reason = ""
        self.checkpoints: dict[int, bool] = {}  # step -> healthy verdict
        self._revoked: list[int] = []
        self.why_unhealthy: dict[int, str] = {}  # checkpoint step -> the evidence that took its healthy tag
        self.target_evidence = ""  # why the last rollback_target is not simply the newest checkpoint
        self.quarantined: dict[str, int] = {}  # rollout server -> the step a per-server rule quarantined it
        self._reset_tracking()

    def _reset_tracking(self) -> None:
        self.last_bad: int | None = None  # newest step at which any rule fired
        self.last_bad_rule = ""
        self.onsets: dict[str, tuple[int, int]] = {}  # rule -> (earliest evidence step, step it fired) since rollback
        self.pending: list[HealthEvent] = []  # fired by checkpoint rules, returned by the next observe()
        self.streak = [0] * len(self.rules)
        self.missing = [0] * len(self.rules)
        self.absences = [0] * len(self.rules)  # times a rule's metric went missing for MISSING_METRIC_WARN_STEPS

    # ------------------------------------------------------------------ per step
    def observe(self, step: int, metrics: dict[str, float]) -> list[HealthEvent]:
        """Run every rule on this step's metrics; returns the events emitted now (plus checkpoint-rule ones)."""
        events, self.pending = self.pending, []
        for i, rule in enumerate(self.rules):
            if rule.PER_SERVER:
                continue  # observe_servers
            self._watch_presence(i, rule, metrics)
            fired = rule.observe(step, metrics)
            event = None if rule.AT_CHECKPOINT else self._judge(i, rule, step, fired)
            if event is not None:
                events.append(event)
        return events

    def observe_servers(self, step: int, servers: dict[str, dict[str, float]]) -> list[HealthEvent]:
        """Run the per-server rules on what the fleet screen saw of each rollout server this step (summed over
        ranks, the same on every rank). Returns the events emitted now; a ``quarantine`` event names a server
        that is not quarantined yet (it is then, in ``quarantined``). Per-server events never touch the
        checkpoints' healthy tags: the groups they judge were kept out of training."""
        events = []
        for rule in (r for r in self.rules if r.PER_SERVER):
            assert isinstance(rule, ServerRule)
            for server, seen in sorted(servers.items()):
                fired = rule.observe_server(step, server, seen)
                if fired is None or server in self.quarantined:
                    continue
                if rule.action == "quarantine":
                    self.quarantined[server] = step
                elif self.events and any(
                    e.server == server and e.rule == rule.spec.name and e.step > step - rule.window
                    for e in self.events[-50:]
                ):
                    continue  # an alert about this server at most once a window
                event = HealthEvent(
                    step,
                    rule.spec.name,
                    rule.action,
                    fired.metric or rule.metric,
                    fired.value,
                    fired.threshold,
                    fired.message,
                    time.time(),
                    server=server,
                )
                self._emit(event)
                events.append(event)
        return events

    def note_refused(self, step: int, refused: int, why: str) -> HealthEvent:
        """A ``fleet_refused`` alert: the learner has waited for step ``step`` while the broker refused what the
        fleet sent (``RefusalWatch``). No rule runs while no step trains, so the stall is written here, for
        events.jsonl to say why the run stands still; it decides nothing (the learner keeps waiting, up to
        ``learner.batch_wait_s``)."""
        event = HealthEvent(step, "fleet_refused", "alert", "broker/implausible", float(refused), 0.0, why, time.time())
        self._emit(event)
        return event

    def on_checkpoint(self, step: int) -> bool:
        """Healthy verdict for the checkpoint saved after ``step``; also runs checkpoint-level rules."""
        for i, rule in enumerate(self.rules):
            event = self._judge(i, rule, step, rule.on_checkpoint(step)) if rule.AT_CHECKPOINT else None
            if event is not None:
                self.pending.append(event)
        healthy = self.last_bad is None or self.last_bad <= step - max(self.cfg.healthy_window, 1)
        self.checkpoints[step] = healthy
        if not healthy:
            self.why_unhealthy[step] = (
                f"{self.last_bad_rule} fired at step {self.last_bad}, within health.healthy_window"
            )
            log.warning(
                "checkpoint at step %d is not tagged healthy: a health rule fired at step %d (within "
                "health.healthy_window=%d steps); rollbacks will skip it",
                step,
                self.last_bad,
                self.cfg.healthy_window,
            )
        return healthy

    def _judge(self, i: int, rule: Rule, step: int, fired: Fired | None) -> HealthEvent | None:
        if fired is None:
            self.streak[i] = 0
            return None
        self.last_bad = step if self.last_bad is None else max(self.last_bad, step)
        self.last_bad_rule = rule.spec.name
        name = rule.spec.name
        self.onsets[name] = (min(fired.since, self.onsets.get(name, (fired.since, step))[0]), step)
        self._revoke(fired.since, step, name)
        self.streak[i] += 1
        if (self.streak[i] - 1) % (rule.window or 1):
            return None  # still firing: repeat the event only every `window` evaluations
        event = HealthEvent(
            step,
            rule.spec.name,
            rule.action,
            fired.metric or rule.metric,
            fired.value,
            fired.threshold,
            fired.message,
            time.time(),
        )
        self._emit(event)
        return event

    def _revoke(self, since: int, step: int, rule: str = "") -> None:
        """Checkpoints inside the evidence of a rule that fired now lose their healthy verdict."""
        for c, healthy in self.checkpoints.items():
            if healthy and since <= c < step:
                self.checkpoints[c] = False
                self._revoked.append(c)
                self.why_unhealthy[c] = f"inside the evidence of {rule} (from step {since}, fired at step {step})"
                log.warning(
                    "checkpoint at step %d is no longer counted healthy: the evidence of a rule that fired at "
                    "step %d starts at step %d",
                    c,
                    step,
                    since,
                )

    def _watch_presence(self, i: int, rule: Rule, metrics: dict[str, float]) -> None:
        """Say when a rule's metric has been absent for MISSING_METRIC_WARN_STEPS steps: at WARNING the first
        time, at DEBUG after: an asynchronous run lacks off_policy/mismatch_kl on most steps (it is measured only
        over tokens the current weights sampled), and a repeated warning would read like a misconfiguration."""
        self.missing[i] = 0 if any(k in metrics for k in rule.watches()) else self.missing[i] + 1
        if self.missing[i] != MISSING_METRIC_WARN_STEPS:
            return
        self.absences[i] += 1
        watched = " / ".join(rule.watches())
        if "off_policy/mismatch_kl" in rule.watches() and "off_policy/fresh_token_frac" in metrics:
            why = (
                "it is measured only over tokens that the learner's current weights sampled, and no trained token "
                "was that fresh (off_policy/fresh_token_frac 0: the rollouts ran ahead within broker.max_staleness); "
                "it fires again on steps that train such tokens"
            )
        else:
            why = f"the rule cannot fire; check {rule.key}.metric or the feature that produces it"
        log.log(
            logging.WARNING if self.absences[i] == 1 else logging.DEBUG,
            "%s (%s) watches %s, which the learner has not reported for %d steps (%d time(s) so far): %s",
            rule.key,
            rule.spec.name,
            watched,
            MISSING_METRIC_WARN_STEPS,
            self.absences[i],
            why,
        )

    def _emit(self, event: HealthEvent) -> None:
        self.events.append(event)
        level = logging.WARNING if event.action == "alert" else logging.ERROR
        log.log(level, "health %s -> %s at step %d: %s", event.rule, event.action, event.step, event.message)
        if self.events_path is not None:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            with self.events_path.open("a") as f:
                f.write(event.to_json() + "\n")

    # ------------------------------------------------------------------ decisions
    def decide(self, events: Iterable[HealthEvent]) -> str:
        """The strongest action among ``events``: none < alert < rollback < stop; a rollback past
        ``health.max_rollbacks`` becomes stop."""
        events = list(events)
        action = max((e.action for e in events), key=ACTION_RANK.__getitem__, default="none")
        if action == "rollback" and self._cooling(events):
            return "alert"
        if action == "rollback" and self.rollbacks_done >= self.cfg.max_rollbacks:
            self.stop_reason = (
                f"rollback limit reached: {self.rollbacks_done} rollbacks done, "
                f"health.max_rollbacks={self.cfg.max_rollbacks}"
            )
            log.error("health: %s; stopping instead of rolling back", self.stop_reason)
            return "stop"
        if action == "stop":
            self.stop_reason = "rule with action stop fired: " + ", ".join(
                f"{e.rule} at step {e.step}" for e in events if e.action == "stop"
            )
        return action

    def _cooling(self, events: list[HealthEvent]) -> bool:
        """A rollback asked for within ``health.rollback_cooldown_steps`` steps of the last one (and not by
        ``non_finite``): the restored weights were healthy, so evidence that is back at once lives outside them (a
        fleet sampling wrong, stale weights, a reward bug) and another rollback now would only spend the budget.
        Emits a ``rollback_cooldown`` alert saying so; the rule rolls back again if it still fires afterwards."""
        wanted = [e for e in events if e.action == "rollback"]
        step = max(e.step for e in wanted)
        cooldown = self.cfg.rollback_cooldown_steps
        if self.last_rollback is None or not 0 < step - self.last_rollback <= cooldown:
            return False
        if any(e.rule == "non_finite" for e in wanted):
            return False  # a non-finite update is never kept
        rules = ", ".join(sorted({e.rule for e in wanted}))
        self._emit(
            HealthEvent(
                step,
                "rollback_cooldown",
                "alert",
                "health/rollbacks",
                float(step - self.last_rollback),
                float(cooldown),
                f"{rules} asked for a rollback {step - self.last_rollback} step(s) after the rollback at step "
                f"{self.last_rollback}: the restored weights were healthy, so the cause is outside them (the fleet, "
                f"the data or the reward); not rolling back again before step {self.last_rollback + cooldown + 1} "
                f"(health.rollback_cooldown_steps={cooldown}); checkpoints meanwhile are not tagged healthy",
                time.time(),
            )
        )
        return True

    def rollback_target(self, candidates: Iterable[int]) -> int | None:
        """Newest of ``candidates`` (steps of complete checkpoints) tagged healthy and older than the start of
        the evidence of every rule that fired within ``health.healthy_window`` steps of the newest firing
        (where the divergence began), or None.

        ``target_evidence`` names, for each newer checkpoint passed over, what ruled it out.
        """
        candidates = sorted(set(candidates))
        recent = {
            r: v
            for r, v in self.onsets.items()
            if self.last_bad is not None and v[1] >= self.last_bad - max(self.cfg.healthy_window, 1)
        }  # the episode that led here
        began = min((since for since, _ in recent.values()), default=None)
        healthy = [c for c in candidates if self.checkpoints.get(c, False) and (began is None or c < began)]
        target = max(healthy, default=None)
        skipped = [c for c in candidates if target is None or c > target]
        reasons = []
        for c in skipped:
            why = self.why_unhealthy.get(c)
            if why is None and began is not None and c >= began:
                rule = min(recent, key=lambda r: recent[r][0])
                why = f"at or after step {began}, where the evidence of {rule} begins"
            reasons.append(f"step {c}: {why or 'not tagged healthy by this monitor'}")
        self.target_evidence = "; ".join(reasons)
        if reasons:
            log.warning(
                "health: rollback target %s; newer checkpoints passed over: %s",
                "none" if target is None else f"step {target}",
                self.target_evidence,
            )
        return target

    def rollback_unavailable(self, step: int, events: Iterable[HealthEvent], checkpoint_interval: int) -> str:
        """A rollback rule fired but no checkpoint is tagged healthy. The run goes on and says so (an
        ``alert`` event naming what is missing and the setting), unless a ``non_finite`` rule fired: then
        the weights themselves are poisoned and only ``stop`` is left. Returns ``alert`` or ``stop``."""
        fired = sorted({e.rule for e in events if e.action == "rollback"})
        if checkpoint_interval == 0:
            why = "checkpoint.interval=0 saves no checkpoint"
        elif not self.checkpoints:
            why = (
                f"the first checkpoint is due at step {checkpoint_interval} (checkpoint.interval={checkpoint_interval})"
            )
        else:
            why = (
                f"every checkpoint so far is inside a rule's evidence (health.healthy_window={self.cfg.healthy_window})"
            )
        poisoned = "non_finite" in fired
        then = (
            "the update was not finite, so the run stops"
            if poisoned
            else "training goes on and the rule keeps alerting; set checkpoint.interval so that rollbacks can act"
        )
        event = HealthEvent(
            step,
            "rollback_unavailable",
            "stop" if poisoned else "alert",
            "health/rollbacks",
            float(self.rollbacks_done),
            float(self.cfg.max_rollbacks),
            f"{', '.join(fired)} asked for a rollback, but no checkpoint is tagged healthy: {why}; {then}",
            time.time(),
        )
        self._emit(event)
        if poisoned:
            self.stop_reason = f"{', '.join(fired)} fired with no healthy checkpoint to roll back to ({why})"
        return event.action

    def rollback_rules_without_checkpoints(self, checkpoint_interval: int) -> list[str]:
        """Rules whose rollback can never act because ``checkpoint.interval`` is 0 (warned at start-up)."""
        return (
            [f"{r.key} ({r.spec.name})" for r in self.rules if r.action == "rollback"]
            if checkpoint_interval == 0
            else []
        )

    def pop_revoked(self) -> list[int]:
        """Checkpoint steps whose healthy tag was withdrawn since the last call (update their meta.json)."""
        out, self._revoked = self._revoked, []
        return out

    def record_rollback(self, to_step: int, from_step: int) -> HealthEvent:
        self.rollbacks_done += 1
        self.last_rollback = from_step
        event = HealthEvent(
            from_step,
            "rollback",
            "rollback",
            "health/rollbacks",
            float(self.rollbacks_done),
            float(self.cfg.max_rollbacks),
            f"rolled back from step {from_step} to the healthy checkpoint at step {to_step} "
            f"(rollback {self.rollbacks_done} of at most {self.cfg.max_rollbacks}); the learning rate "
            f"is multiplied by {self.cfg.lr_factor:g} and groups from the abandoned policy versions "
            f"are discarded"
            + (f"; newer checkpoints passed over: {self.target_evidence}" if self.target_evidence else ""),
            time.time(),
        )
        self._emit(event)
        return event

    def rewind_to(self, state: dict[str, Any] | None, step: int) -> None:
        """After a rollback to the checkpoint at ``step``: the rules' windows as they were then.

        A collapse that goes on after the restore is measured against the baseline the run had at
        the healthy checkpoint (so it fires again and, after max_rollbacks, stops the run). Events,
        the rollback count and the tags of checkpoints up to ``step`` are kept. Without a saved
        state the windows simply start empty (``reset_after_rollback``).
        """
        if state is None:
            self.reset_after_rollback(step)
            return
        kept = (
            self.events,
            self.rollbacks_done,
            self.last_rollback,
            self.stop_reason,
            self.checkpoints,
            self.why_unhealthy,
            self.quarantined,
        )
        self.load_state_dict(state)
        (
            self.events,
            self.rollbacks_done,
            self.last_rollback,
            self.stop_reason,
            checkpoints,
            self.why_unhealthy,
            self.quarantined,
        ) = kept
        self.pending, self.onsets = [], {}
        self.checkpoints = {c: h for c, h in checkpoints.items() if c <= step}

    def reset_after_rollback(self, step: int) -> None:
        """Forget rolling windows and recent firings: training continues from the checkpoint at ``step``."""
        for rule in self.rules:
            rule.rewind(step)
        self._reset_tracking()
        self.checkpoints = {c: h for c, h in self.checkpoints.items() if c <= step}

    # ------------------------------------------------------------------ reporting
    def metrics(self, events: Iterable[HealthEvent] = ()) -> dict[str, float]:
        """Counters for the metric sinks: events this step, all events, rollbacks done."""
        return {
            "health/events": float(len(list(events))),
            "health/events_total": float(len(self.events)),
            "health/rollbacks": float(self.rollbacks_done),
        }

    def report(self) -> str:
        """Every event (what fired, when, the action) for the final stop message."""
        if not self.events:
            return "health: no rule fired"
        n, r = len(self.events), self.rollbacks_done
        lines = [
            f"health report: {n} event{'s' * (n != 1)}, {r} rollback{'s' * (r != 1)} "
            f"(health.max_rollbacks={self.cfg.max_rollbacks})"
        ]
        lines += [f"  step {e.step:>7}  {e.rule} -> {e.action}: {e.message}" for e in self.events]
        if self.stop_reason:
            lines.append(f"stopped: {self.stop_reason}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "rules": [(r.spec.name, r.state_dict()) for r in self.rules],
            "events": [asdict(e) for e in self.events],
            "rollbacks_done": self.rollbacks_done,
            "last_rollback": self.last_rollback,
            "stop_reason": self.stop_reason,
            "checkpoints": dict(self.checkpoints),
            "last_bad": self.last_bad,
            "streak": list(self.streak),
            "pending": [asdict(e) for e in self.pending],
            "onsets": {k: list(v) for k, v in self.onsets.items()},
            "why_unhealthy": dict(self.why_unhealthy),
            "quarantined": dict(self.quarantined),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; a rule whose position or name changed in the config starts fresh (with a warning)."""
        self._reset_tracking()
        saved = state["rules"]
        for i, rule in enumerate(self.rules):
            if i < len(saved) and saved[i][0] == rule.spec.name:
                rule.load_state_dict(saved[i][1])
                self.streak[i] = state["streak"][i]
            else:
                log.warning(
                    "%s (%s) has no saved state (the rule list changed); it starts with empty windows",
                    rule.key,
                    rule.spec.name,
                )
        self.events = [HealthEvent.from_dict(e) for e in state["events"]]
        self.pending = [HealthEvent.from_dict(e) for e in state["pending"]]
        self.rollbacks_done, self.stop_reason = state["rollbacks_done"], state["stop_reason"]
        self.last_rollback = state.get("last_rollback")
        self.checkpoints = {int(k): bool(v) for k, v in state["checkpoints"].items()}
        self.last_bad = state["last_bad"]
        self.onsets = {k: (int(v[0]), int(v[1])) for k, v in state.get("onsets", {}).items()}
        self.why_unhealthy = {int(k): v for k, v in state.get("why_unhealthy", {}).items()}
        self.quarantined = {k: int(v) for k, v in state.get("quarantined", {}).items()}
