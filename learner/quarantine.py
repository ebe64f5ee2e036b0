"""Per-server health in the training loop: one poisoning rollout server is quarantined, not the whole run.

Every step, the fleet screen (learner/screen.py, inside the batch source) has left out the groups no
honest server could have sent and counted them per server. ``FleetGuard.judge`` sums those counts over
the learner ranks (so every rank's monitor judges the same numbers and agrees), runs the per-server
rules (``HealthMonitor.observe_servers``) and, for a server a rule quarantines: every rank's source
leaves that server's later groups out, and rank 0 asks the broker to quarantine it (control
``quarantine``: no more prompts for it, its queued and later groups dropped, their prompts issued to
the others). Training goes on with the rest of the fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as tdist

from fleetrl.common.weightsync import fingerprint
from fleetrl.learner.health import HealthMonitor
from fleetrl.learner.health_rules import HealthEvent
from fleetrl.learner.runtime import Dist
from fleetrl.learner.source import Leased

log = logging.getLogger("fleetrl.learner")


class FleetGuard:
    def __init__(
        self,
        health: HealthMonitor | None,
        source: Any,
        client: Any,
        dist: Dist,
        published: Callable[[int], dict[str, str] | None] = lambda version: None,
    ):
        """``client``: the broker client, or None without a fleet; ``source`` needs ``quarantine(server)``;
        ``published(version)``: the fingerprints of the weights published as ``version`` (None: unknown)."""
        self.health, self.source, self.client, self.dist = health, source, client, dist
        self.published = published
        self.active = health is not None and hasattr(source, "quarantine")
        self.events: list[HealthEvent] = []  # per-server events since the last pop_events

    def judge(self, step: int, leased: Leased) -> dict[str, float]:
        """Per-server rules on this step's screen counts; returns ``fleet/*`` metrics (the same on every rank)."""
        if not self.active:
            return {}
        servers = self.gather(self.stale(leased))
        for event in self.health.observe_servers(step, servers):
            self.events.append(event)
            if event.action == "quarantine":
                self.source.quarantine(event.server)
                if self.dist.is_main and self.client is not None:
                    self.ask_broker(event.server, event.message)
        return {
            "fleet/screened_groups": sum(s.get("screened", 0.0) for s in servers.values()),
            "fleet/quarantined_servers": float(len(self.health.quarantined)),
        }

    def stale(self, leased: Leased) -> dict[str, dict[str, float]]:
        """The screen's counts plus, per server, ``stale``: the kept groups whose weights fingerprint is not the
        one published for the version it names (``stale_version``: the newest such version)."""
        servers = {s: dict(seen) for s, seen in leased.servers.items()}
        for g in leased.groups:
            reported = g.metadata.get("weights_fp") if isinstance(g.metadata, dict) else None
            if not isinstance(reported, (list, tuple)) or len(reported) != 4 or type(reported[0]) is not int:
                continue  # none (an engine that gives none), or not ours to judge: never a crash, never an alarm
            why = fingerprint.mismatch(reported, self.published(reported[0]))
            if why is None:
                continue
            seen = servers.setdefault(g.server_id, {})
            seen["stale"] = seen.get("stale", 0.0) + 1
            seen["stale_version"] = max(seen.get("stale_version", -1.0), float(reported[0]))
            if seen["stale"] == 1:
                log.warning("health: rollout server %s %s", g.server_id, why)
        return servers

    def gather(self, servers: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """Per-server counts summed over the ranks (one all_gather_object when there are several)."""
        if self.dist.world == 1:
            return servers
        parts: list[Any] = [None] * self.dist.world
        tdist.all_gather_object(parts, servers)
        total: dict[str, dict[str, float]] = {}
        for part in parts:
            for server, seen in part.items():
                mine = total.setdefault(server, {})
                for k, v in seen.items():
                    mine[k] = max(mine.get(k, v), v) if k == "stale_version" else mine.get(k, 0.0) + v
        return total

    def ask_broker(self, server: str, reason: str) -> None:
        """Quarantine ``server`` at the broker. A broker that refuses (an older one, without the action) leaves
        the learner's own screen as the guard: the run goes on either way."""
        try:
            self.client.control("quarantine", reason=reason[:500], target=server)
            log.error("health: rollout server %s quarantined at the broker: %s", server, reason)
        except Exception as e:  # noqa: BLE001 - a policy: the learner leaves the server's groups out anyway
            log.warning(
                "health: the broker did not quarantine rollout server %s (%s); the learner leaves its "
                "groups out of training all the same",
                server,
                e,
            )

    def restore(self) -> None:
        """After a resume: the servers the checkpoint's monitor had quarantined stay left out, and the broker
        (which may have restarted since: a quarantine is not spooled) is told again."""
        if not self.active:
            return
        for server in self.health.quarantined:
            self.source.quarantine(server)
            if self.dist.is_main and self.client is not None:
                self.ask_broker(server, f"quarantined at step {self.health.quarantined[server]} (before a restart)")

    def pop_events(self) -> list[HealthEvent]:
        out, self.events = self.events, []
        return out
