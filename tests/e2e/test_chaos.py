"""The short chaos run: SIGKILL a rollout server, the broker and the learner mid-run; nothing
acknowledged is lost or trained twice, versions never go backwards, the run finishes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~32 s here, ~45 s on the CI box
def test_short_chaos_run_loses_and_duplicates_nothing(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from chaos import run_chaos
    finally:
        sys.path.pop(0)
    # 20 steps after the last kill: the tiny learner steps in ~50 ms on queued data, and the controller reaches
    # each kill only once it has seen the previous one recover, so a shorter tail can end before the learner is hit
    report = run_chaos(tmp_path, steps=32, kills=[("rollout-0", 4), ("broker", 8), ("learner", 12)], timeout_s=600)
    assert report["exit_code"] == 0, report
    assert report["kills_survived"] == 3, report["kills"]
    assert report["acknowledged"] > 0 and report["trained"] >= 32 * 4
    assert report["lost"] == 0 and report["duplicated"] == 0
    assert report["versions_monotonic"] and report["reached_final_step"]
    assert {e["child"] for e in report["restarts"]} == {"rollout-0", "broker", "learner"}
