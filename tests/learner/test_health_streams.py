"""The false-alarm sweep's run configurations (benchmarks/health_streams.py) pass `fleetrl run`'s checks."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from health_streams import CONFIGS, overrides  # noqa: E402

from fleetrl.app.checks import check_rewards  # noqa: E402
from fleetrl.common.config.loader import load_config  # noqa: E402


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_sweep_configuration_has_an_unambiguous_held_out_probe(name, tmp_path):
    # online DPO recorded no segment: configs/dpo_online.yaml's format rewards made run.eval_success ambiguous,
    # so `fleetrl run` exited 2 before its first step, every round
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    work = {"model": str(tmp_path / "model"), "train": str(train), "eval": str(train)}
    args = Namespace(mt_groups=2, groups=4, group_size=4, eval_interval=50, eval_n=100)
    cfg = load_config(ROOT / "configs" / f"{CONFIGS[name][0]}.yaml", overrides(name, work, 250, 0, args))
    assert cfg.run.eval_interval == 50 and cfg.data.eval
    assert check_rewards(cfg) == []
    if CONFIGS[name][3] == "arithmetic":
        assert [r.name for r in cfg.rollout.rewards] == ["exact"]


def test_extra_runs_are_judged_like_segments_only_when_they_are_segments(tmp_path):
    from health_streams import healthy_extra

    fell, held, recovery = tmp_path / "fell", tmp_path / "held", tmp_path / "recovery"
    for d in (fell, held, recovery):
        d.mkdir()
    (fell / "done.json").write_text('{"eval_curve": [[0, 0.25], [50, 0.1], [100, 0.12]]}')
    (held / "done.json").write_text('{"eval_curve": [[0, 0.25], [50, 0.3], [100, 0.22]]}')
    (recovery / "done.json").write_text('{"name": "unfaulted-s1", "seed": 1}')  # health_recovery.py's, no curve
    assert [healthy_extra(d) for d in (fell, held, recovery, tmp_path / "metrics.jsonl")] == [False, True, True, True]
