"""Per-server health rules: they judge one rollout server at a time, so one server's poison costs that
server (an alert, or its quarantine at the broker) and never a rollback of the whole run.

Their input is not the step's averaged metrics but, per server, what the fleet screen (learner/screen.py)
saw of it this step, summed over the learner ranks: ``{"groups": n, "screened": k}``. The monitor calls
``observe_server`` for every server that sent groups (``HealthMonitor.observe_servers``). Actions:
``alert`` or ``quarantine``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from fleetrl.learner.health_rules import HEALTH_RULES, Fired, Rule

SERVER_ACTIONS = ("alert", "quarantine")


class ServerRule(Rule):
    """A rule judged per rollout server; ``observe`` (the step's averaged metrics) never fires it."""

    PER_SERVER: ClassVar[bool] = True

    def check(self) -> None:
        if self.action not in SERVER_ACTIONS:
            self.bad("action", f"a per-server rule acts on that server only: one of {', '.join(SERVER_ACTIONS)}")
        self.check_server()

    def check_server(self) -> None:
        """Rule-specific validation (raise with ``self.bad``)."""

    def observe_server(self, step: int, server: str, seen: dict[str, float]) -> Fired | None:
        return None

    def watches(self) -> tuple[str, ...]:
        return ()  # nothing in the step's metrics: no missing-metric warning


class CountingServerRule(ServerRule):
    """A per-server rule over counts of that server's groups in the last ``window`` steps."""

    STATE = ("counts",)

    def reset(self) -> None:
        self.counts: dict[str, deque[tuple[int, float]]] = {}

    def count(self, server: str, step: int, n: float) -> float:
        """Add ``n`` at ``step`` (when > 0), forget what left the window, return the window's total."""
        recent = self.counts.setdefault(server, deque())
        if n > 0:
            recent.append((step, n))
        while recent and recent[0][0] <= step - self.window:
            recent.popleft()
        return sum(c for _, c in recent)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {s: list(d) for s, d in self.counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        for server, points in state.get("counts", {}).items():
            self.counts[server] = deque(tuple(p) for p in points)


@HEALTH_RULES.register("server_poison")
class ServerPoison(CountingServerRule):
    """Fires for a server when the screen left out more than ``threshold`` of its groups over the last
    ``window`` steps: groups no honest server could have sent (impossible log-probs, a reward far outside
    the fleet's). One stray group is left out and counted; a server that keeps sending them is poison."""

    METRIC, WINDOW, THRESHOLD = "server/screened", 20, 2.0

    def check_server(self) -> None:
        if self.threshold < 0:
            self.bad("threshold", "the number of screened groups to tolerate, >= 0 (fires above it), e.g. 2")

    def observe_server(self, step: int, server: str, seen: dict[str, float]) -> Fired | None:
        total = self.count(server, step, seen.get("screened", 0.0))
        recent = self.counts[server]
        if total <= self.threshold:
            return None
        return Fired(
            total,
            self.threshold,
            f"rollout server {server} sent {total:g} groups in the last {self.window} "
            f"steps that no honest server could have sent (more than {self.threshold:g}; the fleet screen left "
            "them out of training): its rewards or log-probs are poison, so that server is isolated and the "
            "run goes on with the others",
            recent[0][0],
            metric=f"server/{server}/screened",
        )


@HEALTH_RULES.register("stale_weights")
class StaleWeights(CountingServerRule):
    """Fires for a server at the first group whose weights fingerprint (``metadata["weights_fp"]``: sampled
    from the engine's live parameters after its load) differs from the one the learner published for the
    version the server reports: new weights announced, other weights served (a silent sync failure). The
    learner's ``FleetGuard`` does the comparing (common/weightsync/fingerprint.py) and counts ``stale``
    groups per server; the rule fires when more than ``threshold`` (0) came within ``window`` steps."""

    METRIC, WINDOW, THRESHOLD = "server/stale_weights", 20, 0.0

    def check_server(self) -> None:
        if self.threshold < 0:
            self.bad("threshold", "the number of stale groups to tolerate, >= 0 (fires above it), e.g. 0")

    def observe_server(self, step: int, server: str, seen: dict[str, float]) -> Fired | None:
        stale = seen.get("stale", 0.0)
        total = self.count(server, step, stale)
        recent = self.counts[server]
        if stale <= 0 or total <= self.threshold:
            return None  # judged on steps with new stale groups: old evidence alone never fires it again
        version = int(seen.get("stale_version", -1))
        return Fired(
            total,
            self.threshold,
            f"rollout server {server} serves weights that are not the learner's policy version {version}: "
            f"{total:g} groups in the last {self.window} steps carried a weights fingerprint (read from the "
            "engine's live parameters after its load) other than the one published for their version. The "
            "sync reported success but the engine kept other weights: check that server's weight load",
            recent[0][0],
            metric=f"server/{server}/stale_weights",
        )
