"""health.rules[].evidence: which of reward_hacking's evidence may fire it (the default: answers and signals)."""

from __future__ import annotations

import pytest

from fleetrl.common.config.learner import HealthConfig, HealthRule
from fleetrl.learner.health import HealthMonitor


def monitor(*rules: HealthRule) -> HealthMonitor:
    return HealthMonitor(HealthConfig(rules=list(rules)), None)


def divergence_stream():
    """Training reward rising while held-out accuracy falls 0.2 and the answers keep their length: only the
    held-out divergence evidence can see it."""
    rows = []
    for step in range(1, 61):
        row = {
            "reward/mean": 0.2 + 0.01 * step,
            "response/length_mean": 3.5,
            "response/distinct_2": 0.5,
            "response/identical_frac": 0.1,
        }
        if step % 10 == 0:
            row["eval/accuracy"] = 0.5 if step <= 30 else 0.3
            row["eval/response_len_mean"] = 3.5
        rows.append((step, row))
    return rows


def fired(m: HealthMonitor, rows) -> list[tuple[int, str]]:
    return [(step, e.rule) for step, row in rows for e in m.observe(step, row)]


def test_the_default_leaves_the_accuracy_divergence_out_and_every_evidence_sees_it():
    assert not fired(
        monitor(HealthRule(name="reward_hacking", action="rollback", evidence=["answers", "signals"])),
        divergence_stream(),
    )
    every = fired(monitor(HealthRule(name="reward_hacking", action="rollback")), divergence_stream())
    assert every and every[0][1] == "reward_hacking" and every[0][0] == 40
    only = fired(
        monitor(HealthRule(name="reward_hacking", action="rollback", evidence=["divergence"])), divergence_stream()
    )
    assert only == every


def test_evidence_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match=r"evidence.*only reward_hacking takes evidence"):
        monitor(HealthRule(name="reward_drop", evidence=["answers"]))
    with pytest.raises(ValueError, match=r"evidence.*at least one of divergence, answers, signals"):
        monitor(HealthRule(name="reward_hacking", evidence=[]))
