"""Every per-algorithm smoke config in configs/ runs a few steps through real processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fleetrl.common.data.tasks import eval_path, init_data
from tests.e2e.conftest import RunProcess, read_jsonl

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "dpo_online", "grpo_lora"]
# these differ from grpo only in the loss and the advantages (unit-tested in tests/learner/algorithms) and run the
# same processes; their ~7.5 s each go to the slow lane, which keeps make test near its 10 minutes on the CI box
SLOW = {"drgrpo", "gspo", "rloo", "reinforce_pp"}
EXPECTED = {  # metrics a run of that config must report (finite) at every step
    "ppo": ["critic/value_loss", "critic/vpred_mean", "critic/explained_variance", "critic/clipfrac", "actor/kl"],
    "dpo_online": ["dpo/loss", "dpo/pairs", "dpo/tied_groups", "dpo/accuracy"],
}


@pytest.mark.parametrize("name", [pytest.param(a, marks=pytest.mark.slow) if a in SLOW else a for a in ALGORITHMS])
def test_smoke_config_runs(name, tmp_path, tiny_model_dir, arith_data):
    run_dir = tmp_path / "run"
    run = RunProcess(
        run_dir,
        str(ROOT / "configs" / f"{name}.yaml"),
        [
            f"model.path={tiny_model_dir}",
            f"data.train={arith_data}",
            "learner.total_steps=2",
            "run.ready_timeout_s=240",
        ],
    )
    try:
        code = run.wait()
        assert code == 0, run.output()
    finally:
        run.stop()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/grad_norm"] >= 0 and r["policy/version"] == r["step"] for r in rows)
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for r in rows for v in r.values()), rows
    stepped = [r for r in rows if not r.get("dpo/skipped_step")]  # online DPO skips a step whose groups all tie
    for key in EXPECTED.get(name, []):
        assert all(key in r for r in stepped), key
    if name == "dpo_online":  # groups became pairs and the learner stepped on them
        assert stepped and all(r["dpo/pairs"] > 0 for r in stepped)
        assert all(r["dpo/pairs"] + r["dpo/tied_groups"] == r["batch/groups"] for r in rows)


def test_offline_dpo_starts_only_the_learner(tmp_path, tiny_model_dir):
    pref, _ = init_data("arithmetic-preference", str(tmp_path / "pref.jsonl"), 200, 50, 0, 99)
    run_dir = tmp_path / "run"
    run = RunProcess(
        run_dir,
        str(ROOT / "configs" / "dpo_offline.yaml"),
        [
            f"model.path={tiny_model_dir}",
            f"data.preference={pref}",
            f"data.preference_eval={eval_path(pref)}",
            "learner.total_steps=2",
            "run.ready_timeout_s=240",
        ],
    )
    try:
        code = run.wait()
        out = run.output()
        assert code == 0, out
    finally:
        run.stop()
    assert "1 processes ready" in out and not (run_dir / "broker.json").exists()
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["learner.log"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: held-out accuracy of the starting point
    assert rows[0]["dpo/heldout_accuracy"] == 0.0 and all(r["dpo/pairs"] == 16 for r in rows[1:])
    assert all(math.isfinite(r["dpo/loss"]) and "dpo/heldout_accuracy" in r for r in rows[1:])
    assert (run_dir / "checkpoints" / "step-00000002" / "hf" / "model.safetensors").exists()
