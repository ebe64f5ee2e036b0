"""`fleetrl run` end to end: real broker, rollout and learner processes on the tiny model."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from tests.e2e.conftest import RunProcess, job_args, read_jsonl, wait_for


def test_run_trains_publishes_and_checkpoints(tmp_path, tiny_model_dir, arith_data, empty_config):
    run_dir = tmp_path / "run"
    args = [a if a != "rollout.group_size=4" else "num_generations=4" for a in job_args(tiny_model_dir, arith_data)]
    run = RunProcess(run_dir, empty_config, args)  # TRL's name for the group size: one note, from `fleetrl run`
    try:
        code = run.wait()
        out = run.output()
        assert code == 0, out
    finally:
        run.stop()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["policy/version"] == 3 and all(r["batch/samples"] == 16 for r in rows)
    rollout = read_jsonl(run_dir / "rollout-0.metrics.jsonl")
    assert max(r["rollout/policy_version"] for r in rollout) >= 1, "the rollout server never loaded new weights"
    assert (run_dir / "config.yaml").exists() and (run_dir / "logs" / "learner.log").exists()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "Setting accelerator to CPU" not in learner_log and "reward_mean=" in learner_log  # quiet, and labelled
    weight_lines = [
        ln for ln in (run_dir / "logs" / "rollout-0.log").read_text().splitlines() if " I " in ln and "weight" in ln
    ]  # INFO lines about weights: one per version the server took in
    taken = [re.search(r"policy version \d+ -> (\d+):", ln) for ln in weight_lines]
    assert weight_lines and all(taken) and len({m.group(1) for m in taken}) == len(weight_lines), weight_lines
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*/meta.json"))
    assert [p.parent.name for p in checkpoints] == ["step-00000002", "step-00000003"]
    assert (checkpoints[-1].parent / "hf" / "model.safetensors").exists()
    assert "samples/s" in out and "done" in out
    cpu = json.loads((run_dir / "cpu.json").read_text())  # the CPU meter: every child, over the RL phase
    assert {"learner", "broker", "rollout-0"} <= set(cpu["per_child"]) and cpu["cores_busy"] > 0
    assert "CPU during RL" in out
    assert f"watch it with `fleetrl status --broker {run_dir}`" in out and "broker at tcp://127.0.0.1:" in out
    assert out.count("fleetrl run: note: num_generations=4 is read as rollout.group_size=4") == 1, out
    assert not [p.name for p in (run_dir / "logs").glob("*.log") if "is read as" in p.read_text()]  # not the children
    assert re.search(
        r"3 processes ready in [0-9.]+ s \(checks done at [0-9.]+ s; ready: broker at [0-9.]+, "
        r"rollout-0 at [0-9.]+, learner at [0-9.]+ s\)",
        out,
    ), out
    for name in ("broker", "rollout-0", "learner"):  # each child says where its start-up went
        assert re.search(
            r"start-up: ready [0-9.]+ s after exec \(python\+imports [0-9.]+, ",
            (run_dir / "logs" / f"{name}.log").read_text(),
        ), name


def test_sigint_stops_everything_with_a_checkpoint(tmp_path, tiny_model_dir, arith_data, empty_config):
    run_dir = tmp_path / "run"
    run = RunProcess(
        run_dir,
        empty_config,
        job_args(tiny_model_dir, arith_data, "learner.total_steps=100000", "checkpoint.interval=0"),
    )
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 300, "two learner steps")
        children = run.child_pids()
        assert len(children) >= 3
        run.proc.send_signal(2)  # SIGINT, as Ctrl-C
        assert run.wait(180) == 130
    finally:
        run.stop()
    assert not [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    last = sorted((run_dir / "checkpoints").glob("step-*/meta.json"))
    assert last, "no final checkpoint on Ctrl-C"
    assert json.loads(last[-1].read_text())["step"] >= 2


def test_a_child_failing_at_start_is_named(tmp_path, tiny_model_dir, arith_data, empty_config):
    run_dir = tmp_path / "run"
    run = RunProcess(run_dir, empty_config, job_args(tiny_model_dir, arith_data, "rollout.engine=vllm"))
    try:
        code = run.wait(300)
        out = run.output()
    finally:
        run.stop()
    assert code != 0
    assert "rollout-0" in out and ("vllm" in out.lower())
    assert not run.child_pids()


@pytest.mark.slow
@pytest.mark.parametrize("function, says", [("boom", "failed on"), ("no_score", "returned None (no score) for all")])
def test_a_run_whose_reward_never_works_stops_naming_it(
    tmp_path, tiny_model_dir, arith_data, empty_config, function, says
):
    run_dir = tmp_path / "run"
    rewards = f"rollout.rewards=[{{name: python, args: {{function: 'tests.rollout.user_rewards:{function}'}}}}]"
    run = RunProcess(
        run_dir,
        empty_config,
        job_args(tiny_model_dir, arith_data, rewards, "learner.total_steps=50", "run.restart_policy=on-failure"),
    )
    try:
        code = run.wait(240)
        out = run.output()
    finally:
        run.stop()
    assert code == 1, out
    assert "no sample got a usable reward" in out and f"'{function}' (rollout.rewards[0]) {says}" in out
    assert "restarting" not in out  # a restart would score nothing again
    assert not run.child_pids()


@pytest.mark.slow
def test_a_run_whose_reward_starts_failing_mid_run_stops_naming_it(tmp_path, tiny_model_dir, arith_data, empty_config):
    """A reward that scores the first 48 samples, then raises on every one: the run trains, then stops with exit 1
    and a line naming the reward (issue 30: a mid-run failure was counted and shown, but the run went on)."""
    run_dir = tmp_path / "run"
    rewards = "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:works_then_breaks'}}]"
    run = RunProcess(
        run_dir,
        empty_config,
        job_args(tiny_model_dir, arith_data, rewards, "learner.total_steps=200", "run.restart_policy=on-failure"),
    )
    try:
        code = run.wait(300)
        out = run.output()
    finally:
        run.stop()
    assert code == 1, out
    assert "the rewards stopped working: the last 32 samples got no usable reward (after 48 usable ones)" in out
    assert "'works_then_breaks' (rollout.rewards[0]) failed on 32 of 32 samples" in out and "ConnectionError" in out
    assert "rollout.reward_stop_after=32 samples in a row" in out and "restarting" not in out
    assert read_jsonl(run_dir / "metrics.jsonl"), "the learner never trained on the samples that had a reward"
    assert not run.child_pids()
