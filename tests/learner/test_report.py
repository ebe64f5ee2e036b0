"""`fleetrl report`: the plots and the page, with rollbacks marked on the timeline."""

from __future__ import annotations

import json

import pytest

from fleetrl.learner.report import build_report

pytest.importorskip("matplotlib")


def test_report_marks_rollbacks(tmp_path):
    rows = [{"step": s, "time": float(s), "reward/mean": 0.5 - 0.1 * (s in (5, 6))} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [{"step": 6, "rule": "reward_drop", "action": "rollback"}, {"step": 6, "rule": "rollback", "action": "rollback"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    page = build_report(tmp_path).read_text()
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0
    assert page.count("<b>") == 1 and "&quot;rule&quot;: &quot;rollback&quot;" in page and "red dashed lines" in page
