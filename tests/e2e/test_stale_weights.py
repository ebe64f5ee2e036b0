"""`stale_weights` catches a fleet that reports new versions but serves old weights, and is quiet otherwise.

Each run is `fleetrl run` (broker, an HF rollout server, a learner) on the tiny model, as in
test_mismatch_faults.py; only `stale_weights` runs (an alert). The rollout server fingerprints its engine's
live parameters after every load (common/weightsync/fingerprint.py) and the learner compares with what it
published for that version.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_mismatch_faults import run_with_fault

RULES = "health.rules=[{name: stale_weights, action: alert}]"


@pytest.mark.slow
def test_a_stale_fleet_fires_stale_weights_within_a_few_steps(
    tmp_path, monkeypatch, tiny_model_dir, arith_data, empty_config
):
    metrics, events = run_with_fault(
        tmp_path, monkeypatch, tiny_model_dir, arith_data, empty_config, "stale_fleet", rules=RULES, steps=10
    )
    fired = [e for e in events if e["rule"] == "stale_weights"]
    assert fired, f"stale_weights never fired; events: {events}"
    first = fired[0]
    assert first["action"] == "alert" and first["server"], first
    assert first["step"] <= 6, first  # the fault starts at version 2 (published after step 2)
    assert "policy version" in first["message"] and first["server"] in first["message"]


@pytest.mark.slow
def test_an_honest_run_never_fires_stale_weights(tmp_path, monkeypatch, tiny_model_dir, arith_data, empty_config):
    metrics, events = run_with_fault(
        tmp_path, monkeypatch, tiny_model_dir, arith_data, empty_config, None, rules=RULES, steps=10
    )
    assert not [e for e in events if e["rule"] == "stale_weights"], events
    assert len(metrics) >= 10
