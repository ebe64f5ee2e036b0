"""Time to TRL's accuracy (benchmarks/vs_trl.py), on hand-made curves whose answer is known."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from curves import combine, smoothed, time_to, time_to_trl_accuracy  # noqa: E402


def curve(*points):
    return [{"step": 20 * i, "time_s": t, "accuracy": a} for i, (t, a) in enumerate(points)]


# TRL: 0.30 at the start, ends near 0.40; trailing 3-point means 0.30, 0.30, 0.30, 0.333, 0.367, 0.40
TRL = curve((0, 0.3), (30, 0.3), (60, 0.3), (90, 0.4), (120, 0.4), (150, 0.4), (200, 0.9))
# fleetrl: climbs fast; trailing means 0.30, 0.35, 0.40 (at 20 s), ...
FAST = curve((0, 0.3), (10, 0.4), (20, 0.5), (30, 0.6))


def test_smoothing_is_a_trailing_mean_within_the_budget():
    s = smoothed(TRL, budget_s=180)
    assert [t for t, _ in s] == [0, 30, 60, 90, 120, 150]  # the 200-s evaluation is past the budget
    assert abs(s[3][1] - (0.3 + 0.3 + 0.4) / 3) < 1e-12 and abs(s[-1][1] - 0.4) < 1e-12


def test_time_to_is_the_first_smoothed_crossing_or_none():
    assert time_to(FAST, 0.4, 180) == 20
    assert time_to(FAST, 0.95, 180) is None
    assert time_to(TRL, 0.4, 180) == 150  # one spike (the raw 0.4 at 90 s) does not count: smoothed


def test_speedup_is_trls_time_over_ours():
    t = time_to_trl_accuracy(FAST, TRL, 180)
    assert abs(t["target"] - 0.4) < 1e-12 and t["trl_s"] == 150 and t["mine_s"] == 20
    assert abs(t["speedup"] - 7.5) < 1e-12
    slow = curve((0, 0.3), (100, 0.3), (170, 0.3))
    assert time_to_trl_accuracy(slow, TRL, 180)["speedup"] is None  # never reached: no speedup claimed
    flat = curve((0, 0.3), (90, 0.3))
    assert time_to_trl_accuracy(FAST, flat, 180)["speedup"] is None  # TRL ends where both started: undefined


def report(tmp_path: Path, name: str, fast_samples: int) -> str:
    summary = {
        "fleetrl-async": {
            "status": "ok",
            "samples_per_s": fast_samples,
            "final_accuracy": 0.6,
            "others_cpu_share": 0.0,
            "mean_accuracy_over_budget": 0.5,
        },
        "trl": {
            "status": "ok",
            "samples_per_s": 100.0,
            "final_accuracy": 0.4,
            "others_cpu_share": 0.0,
            "mean_accuracy_over_budget": 0.35,
        },
    }
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "minutes_per_system": 3,
                "summary": summary,
                "runs": {"fleetrl-async": {"curve": FAST}, "trl": {"curve": TRL}},
            }
        )
    )
    return str(path)


def test_combine_prints_the_median_over_seeds(tmp_path, capsys):
    paths = [report(tmp_path, f"s{i}.json", n) for i, n in enumerate((80, 120, 150))]
    assert combine(paths) == 0
    out = capsys.readouterr().out
    assert "median over 3 seeds: samples/s 1.20x TRL's; time to TRL's accuracy 7.50x sooner" in out


def test_trl_budget_callback_decays_lr_over_the_budget_like_lr_decay_by_time(tmp_path, monkeypatch):
    """--lr-decay time: before each TRL step the lr is LR x (1 - share of the budget used), as fleetrl's
    learner.lr_decay_by: time with a linear schedule; without it the callback leaves the lr alone."""
    import time

    import torch
    from harness import LR
    from trl_system import make_budget_callback

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    for decay, expected in ((True, [LR, 0.75 * LR, 0.0]), (False, [LR, LR, LR])):
        cb = make_budget_callback(60.0, 10**6, 128, None, [], tmp_path / "curve.jsonl", decay_by_time=decay)
        cb.t0 = now[0] = 100.0  # what on_train_begin does after scoring the warm start
        seen = []
        for elapsed in (0.0, 15.0, 75.0):
            now[0] = 100.0 + elapsed
            opt.param_groups[0]["lr"] = LR  # TRL's constant scheduler, after the previous step
            cb.on_step_begin(None, None, None, optimizer=opt)
            seen.append(opt.param_groups[0]["lr"])
        assert seen == [pytest.approx(x) for x in expected]
