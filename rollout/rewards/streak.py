"""Samples in a row that got no usable reward: what stops a rollout server whose rewards do not work.

A sample is *usable* when some reward scored it and none failed on it. ``RewardScorer`` feeds every
scored sample here, in order; a usable one ends the streak. Once ``limit`` samples in a row were
unusable (``rollout.reward_stop_after``) the server stops with a message naming each reward, its
config entry and what it did over the streak: at the start of a run (the rewards never worked) or
later (a judge that went away, a function that breaks on later data). Half way there it warns once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class UnusableStreak:
    """The current run of unusable samples; ``parts`` are (label, config key) of the configured rewards."""

    parts: list[tuple[str, str]]
    limit: int
    length: int = 0
    usable: int = 0  # usable samples seen so far (all of them before the streak)
    failed: Counter[str] = field(default_factory=Counter)  # per label: samples of the streak it failed on
    unscored: Counter[str] = field(default_factory=Counter)  # per label: samples of the streak it returned None for
    first_error: dict[str, str] = field(default_factory=dict)  # per label: its first failure in the streak
    stopped: str | None = None  # the reason, fixed when the streak first reached the limit

    def add(self, usable: bool, failed: dict[str, str], unscored: list[str]) -> bool:
        """Count one sample (``failed``: label -> reason of each part that failed on it; ``unscored``: labels
        that returned None). True exactly when the streak reaches half the limit: the moment to warn."""
        if usable:
            self.usable += 1
            self.length = 0
            self.failed.clear()
            self.unscored.clear()
            self.first_error.clear()
            return False
        self.length += 1
        for label, reason in failed.items():
            self.failed[label] += 1
            self.first_error.setdefault(label, reason)
        self.unscored.update(unscored)
        if self.limit and self.length == self.limit and self.stopped is None:
            self.stopped = self._reason()  # samples scored before the server stops do not change what it says
        return bool(self.limit) and self.length == max(1, self.limit // 2) < self.limit

    def what_each_did(self) -> str:
        n, said = self.length, []
        for label, key in self.parts:
            if self.failed[label]:
                said.append(
                    f"reward {label!r} ({key}) failed on {self.failed[label]} of {n} samples "
                    f"(first: {self.first_error.get(label, '?')})"
                )
            elif self.unscored[label] == n:
                said.append(f"reward {label!r} ({key}) returned None (no score) for all {n} samples")
        return "; ".join(said) or "their weighted sum was not a finite number"

    def why(self) -> str | None:
        """Why the server stops, once ``limit`` samples in a row were unusable; else None."""
        return self.stopped

    def _reason(self) -> str:
        n = self.length
        head = (
            f"no sample got a usable reward in the first {n}"
            if not self.usable
            else f"the rewards stopped working: the last {n} samples got no usable reward (after {self.usable} "
            "usable ones)"
        )
        return (
            f"{head}: {self.what_each_did()}. Nothing can be trained on; fix the function(s) or rollout.rewards "
            "(test one with `fleetrl config validate`; rollout.reward_stop_after sets how many samples in a row "
            "stop the server, 0 never)"
        )
