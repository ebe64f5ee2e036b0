"""The verifiers lane's end-to-end check: `fleetrl verifiers-data` exports the local taskset `fleet_arith`, then
`fleetrl run` (real broker, rollout and learner processes) trains the tiny model on it for a few steps with
`rollout.env.type: verifiers`: the rubric's reward and its parts are recorded in the metrics, and the weights
moved."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.e2e.conftest import RunProcess, read_jsonl
from tests.verifiers.conftest import HERE
from tests.verifiers.fleet_arith import digit_share

STEPS = 4


def test_fleetrl_run_trains_a_verifiers_taskset(tmp_path, tiny_model_dir):
    empty_config = tmp_path / "job.yaml"
    empty_config.write_text("{}\n")
    data = tmp_path / "tasks.jsonl"
    job = [
        f"model.path={tiny_model_dir}",
        f"data.train={data}",
        f"run.python_path=[{HERE}]",
        "rollout.env.type=verifiers",
        "rollout.env.verifiers.taskset=fleet_arith",
        "rollout.env.verifiers.args={n: 64, seed: 1}",
        "rollout.group_size=4",
        "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=4",
        "learner.groups_per_step=4",
        f"learner.total_steps={STEPS}",
        "learner.lr=1e-3",
        "sync.transport=filesystem",
        f"checkpoint.interval={STEPS}",
        "broker.max_staleness=1",
        "run.ready_timeout_s=240",
        "rollout.device=cpu",
        "learner.device=cpu",
    ]
    cli = [sys.executable, "-m", "fleetrl.app.cli"]
    held_out = tmp_path / "held_out.jsonl"
    for extra, says in (
        (["--limit", "8", "--out", str(held_out)], f"wrote 8 tasks of verifiers taskset 'fleet_arith' to {held_out}"),
        (["--skip", "8"], f"wrote 56 tasks of verifiers taskset 'fleet_arith' to {data}"),  # data.train
    ):
        exported = subprocess.run(
            [*cli, "verifiers-data", "--config", str(empty_config), *extra, *job],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert exported.returncode == 0, exported.stdout + exported.stderr
        assert says in exported.stdout
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    held = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert all("vf_task" in r for r in rows) and not {r["vf_key"] for r in rows} & {r["vf_key"] for r in held}

    run_dir = tmp_path / "run"
    run = RunProcess(run_dir, str(empty_config), job)
    try:
        code = run.wait(420)
        out = run.output()
    finally:
        run.stop()
    assert code == 0, out
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))

    # the rubric's reward and its parts, recorded like any reward's: per step, over the samples trained
    for r in steps:  # the reward is the rubric's weighted sum, exact x 1 + digits x 0.5
        assert r["reward/mean"] == pytest.approx(r["reward/exact/mean"] + 0.5 * r["reward/digits/mean"], abs=1e-6)
    assert max(r["reward/mean"] for r in steps) > 0, "every reward was 0: nothing to learn from"
    rollout = read_jsonl(run_dir / "rollout-0.metrics.jsonl")  # the rollout server's means: parts and metrics
    assert any("reward/digits/mean" in r and r.get("verifiers/reply_chars/mean", 0) > 0 for r in rollout)
    assert max(r["env/episodes_total"] for r in rollout) >= 16  # the episodes ran through the environment
    assert max(r["env/errors_total"] for r in rollout) == 0

    # the weights moved: the checkpoint's export differs from the model it started from
    before = load_file(f"{tiny_model_dir}/model.safetensors")
    after = load_file(str(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "hf" / "model.safetensors"))
    moved = [k for k in before if k in after and not before[k].equal(after[k])]
    assert moved, "no weight changed after training"

    # `fleetrl eval` of the trained model on the held-out tasks: each greedy reply scored by the rubric
    model = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "hf"
    report = tmp_path / "eval.json"
    evaluated = subprocess.run(
        [*cli, "eval", "--config", str(empty_config), "--model", str(model), "--data", str(held_out), "--k", "0"]
        + ["--success", "1.0", "--out", str(report), *job],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    records = json.loads(report.read_text())["rows"]
    assert len(records) == 8
    for r in records:
        reply = r["greedy"].strip()
        assert r["greedy_reward"] == pytest.approx(float(reply == r["answer"]) + 0.5 * digit_share(reply))
