"""benchmarks/health_replay.py counts false alerts / rollbacks on a synthetic stream, with exact bounds."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from health_replay import main, poisson_upper, rates, read_stream, replay, summarize  # noqa: E402

from fleetrl.common.config.learner import HealthConfig, HealthRule  # noqa: E402


def test_poisson_upper_bound_is_exact():
    assert poisson_upper(0) == pytest.approx(-math.log(0.05), rel=1e-9)  # 2.9957: the rule of three
    # P(X <= 1 | mu) = e^-mu (1 + mu) = 0.05 at mu = 4.7439; P(X <= 2 | mu) = 0.05 at mu = 6.2958
    assert poisson_upper(1) == pytest.approx(4.7439, abs=1e-4)
    assert poisson_upper(2) == pytest.approx(6.2958, abs=1e-4)
    assert rates(0, 30_000)["upper95_per_10k"] == pytest.approx(0.9986, abs=1e-4)


def stream(tmp_path: Path) -> Path:
    # 100 steps: the grad norm is 1.0 except 100.0 at steps 30
    # and 70 (2 grad_spike alerts), and one NaN loss at step 50 (1 non_finite rollback); an evaluation
    # row at step 0 and a non-numeric field are ignored
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for step in range(1, 101):
        row = {"step": step, "actor/grad_norm": 100.0 if step in (30, 70) else 1.0, "actor/loss": 0.1, "note": "x"}
        if step == 50:
            row["actor/loss"] = float("nan")
        rows.append(row)
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(r) for r in rows))  # json writes NaN as NaN, as the learner's sink does
    return path


RULES = [HealthRule(name="grad_spike", action="alert", window=5), HealthRule(name="non_finite", action="rollback")]


def test_replay_counts_alerts_and_rollbacks_per_rule(tmp_path):
    rows = read_stream(stream(tmp_path).parent)
    assert len(rows) == 100
    got = replay(rows, HealthConfig(rules=RULES))
    assert got["steps"] == 100
    assert dict(got["alerts"]) == {"grad_spike": 2} and dict(got["rollbacks"]) == {"non_finite": 1}
    assert [e["step"] for e in got["events"]] == [30, 50, 70]
    summary = summarize({"a": got, "b": got}, HealthConfig(rules=RULES))  # two streams: 200 steps
    assert summary["steps"] == 200
    spike = summary["rules"]["grad_spike"]
    assert spike["alerts"]["count"] == 4 and spike["alerts"]["per_10k"] == pytest.approx(200.0)
    assert spike["rollbacks"]["count"] == 0 and spike["rollbacks"]["upper95_per_10k"] == pytest.approx(
        10_000 * 2.9957 / 200, rel=1e-4
    )
    assert summary["rules"]["non_finite"]["rollbacks"]["count"] == 2
    assert summary["all"]["alerts"]["count"] == 4 and summary["all"]["rollbacks"]["count"] == 2


def test_the_command_line_writes_the_figures(tmp_path, capsys):
    path = stream(tmp_path)
    out = tmp_path / "replay.json"
    rules = json.dumps([{"name": "grad_spike", "action": "alert", "window": 5}])
    assert main([str(path), "--rules", rules, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rules"]["grad_spike"]["alerts"]["count"] == 2
    assert "100 healthy steps in 1 streams" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 2
