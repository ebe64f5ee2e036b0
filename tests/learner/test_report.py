"""`fleetrl report`: smoothed curves over faint raw values, one plot per reward function, health events on the
step axis, the latest completions, and the newest row of each step after a resume."""

from __future__ import annotations

import json
import math
import random

import pytest

from fleetrl.learner.report import build_report, event_marks, latest_per_step, read_jsonl, smooth


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run_dir(tmp_path):
    rng = random.Random(0)
    rows = [
        {
            "step": s,
            "time": 1000.0 + s,
            "reward/mean": s / 100 + rng.random() * 0.2,
            "reward/exact/mean": s / 120,
            "reward/accuracy_reward/mean": 0.5,
            "off_policy/staleness_mean": rng.choice([0, 1, 2]),
            "broker/queue_depth": rng.randint(0, 16),
        }
        for s in range(1, 81)
    ]
    resumed = [{**r, "reward/mean": -1.0, "time": r["time"] + 500} for r in rows[59:]]  # steps 60.. logged again
    write(tmp_path / "metrics.jsonl", rows + resumed)
    write(
        tmp_path / "events.jsonl",
        [{"step": s, "rule": "reward_drop", "action": "alert", "message": "dropped"} for s in (20, 25, 30)]
        + [{"time": 1040.5, "event": "restart", "child": "broker", "exit_code": -9, "restart": 1}],
    )
    write(
        tmp_path / "completions.jsonl",
        [
            {
                "step": 80,
                "policy_version": 79,
                "prompt": "<b>1+1=</b>",
                "response": "2",
                "reward": 1.0,
                "advantage": 0.25,
                "finish_reason": "stop",
                "tokens": 2,
            }
        ],
    )
    return tmp_path


def test_smoothing_is_a_debiased_moving_average():
    assert smooth([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0])  # debiased: no pull towards 0
    # weight 0.5: 1, (0.5*0.5 + 0.5*3) / 0.75 = 2.333...
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75])
    noisy = [(-1) ** i for i in range(200)]
    assert max(abs(x) for x in smooth(noisy)[50:]) < 0.1  # an alternating series reads as its mean


def test_resumed_steps_keep_the_newest_row():
    rows = latest_per_step([{"step": 1, "v": 1}, {"step": 2, "v": 2}, {"step": 2, "v": 3}, {"note": "no step"}])
    assert rows == [{"step": 1, "v": 1}, {"step": 2, "v": 3}]


def test_report_has_a_plot_per_reward_function_events_and_completions(run_dir):
    out = build_report(run_dir)
    page = out.read_text()
    plots = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert {"reward.png", "reward_exact.png", "reward_accuracy_reward.png", "staleness.png", "queue.png"} <= set(plots)
    assert "80 steps" in page  # the 21 steps logged again after the resume are not counted twice
    assert "reward_drop -&gt; alert</b>: 3 time(s), steps 20–30" in page and "restart broker" in page
    assert "&lt;b&gt;1+1=&lt;/b&gt;" in page and "<b>1+1=</b>" not in page  # completions are escaped
    marks = event_marks(read_jsonl(run_dir / "events.jsonl"), latest_per_step(read_jsonl(run_dir / "metrics.jsonl")))
    assert marks[-1] == (40, "restart broker")  # a timed event lands on the step logged at that time
    rows = latest_per_step(read_jsonl(run_dir / "metrics.jsonl"))
    assert all(r["reward/mean"] == -1.0 for r in rows[59:]) and not any(math.isnan(r["reward/mean"]) for r in rows)
