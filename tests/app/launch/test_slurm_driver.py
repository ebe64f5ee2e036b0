"""The Slurm job driver's failure path, with real processes in place of the srun steps: a supervisor's failure
report ends the job at once, although the failed role's step still runs (as a step with a task on a node that
is cut off does), the cause names every report with its last log line, and cluster.slurm.requeue_on_failure
requeues the job (a stand-in `scontrol` on PATH records the call) until it is used up."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetrl.app.launch import slurm_job
from fleetrl.app.launch.slurm import render_job
from fleetrl.app.launch.slurm_job import Driver
from fleetrl.common.config import load_config

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = [
    "cluster.share_nodes=false",
    "cluster.slurm.broker_own_node=true",
    "cluster.slurm.requeue_on_failure=1",
    "checkpoint.interval=10",
]
RANK0 = "...\nfleetrl learner: FAILED: learner rank 1 on n3 not heard from for 15.2 s (learner.peer_timeout_s=15, ...)"
RANK1 = "...\nfleetrl learner: FAILED: learner rank 1 on n3 has not reached the rendezvous store at n2:23502 ..."


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in `scontrol` that appends its arguments to a file; the driver finds it on PATH."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FLEETRL_ALLOC_START", str(time.time()))  # restored after the test (the driver sets it)
    monkeypatch.setattr(slurm_job, "REQUEUE_WAIT_S", 0.0)
    return calls


def driver(run: Path, restart_count: int) -> Driver:
    render_job(load_config(ROOT / "configs" / "demo.yaml", LAYOUT), run)
    plan = json.loads((run / "launch" / "job.plan.json").read_text())
    env = {
        **os.environ,
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_RESTART_COUNT": str(restart_count),
    }
    d = Driver(plan, env)
    for step in d.steps:  # each step "runs" until told to stop (SIGUSR1 ends it, as srun forwards it)
        step.argv = [sys.executable, "-c", "import time; time.sleep(120)"]
    return d


def report_later(run: Path) -> None:
    """Rank 0's supervisor reports after 1 s, rank 1's (on the cut node) a moment later."""

    def write():
        time.sleep(1.0)
        for host, tail, code in (("n2", RANK0, 7), ("n3", RANK1, 7)):
            record = {
                "time": time.time(),
                "role": "learner",
                "child": "learner" if host == "n2" else "learner-node1",
                "host": host,
                "code": code,
                "message": "",
                "log": f"/logs/{host}",
                "tail": tail,
            }
            (run / "launch" / f"failed-learner-{host}.json").write_text(json.dumps(record))
            time.sleep(0.2)

    threading.Thread(target=write, daemon=True).start()


def test_a_reported_learner_failure_requeues_the_job_naming_the_rank_and_host(tmp_path, scontrol):
    d = driver(tmp_path, restart_count=0)
    report_later(tmp_path)
    t0 = time.monotonic()
    assert d.run() == 0  # requeued: the batch script ends cleanly, Slurm starts the job again
    assert time.monotonic() - t0 < 20, "the driver waited for the failed step to end by itself"
    assert scontrol.read_text().split() == ["requeue", "42"]
    result = json.loads((tmp_path / "launch" / "result.json").read_text())
    assert result["state"] == "requeued" and result["role"] == "learner"
    assert result["cause"].startswith(
        "learner on n2 exited with code 7: fleetrl learner: FAILED: learner rank 1 on n3 not heard from"
    ), result
    assert "learner-node1 on n3 exited with code 7" in result["cause"]
    events = [json.loads(line) for line in (tmp_path / "launch" / "events.jsonl").read_text().splitlines()]
    assert [e["why"] for e in events if e["event"] == "requeue"] == [
        "the learner failed; requeue 1 of 1 (cluster.slurm.requeue_on_failure), resuming from the last checkpoint"
    ]
    assert all(s.poll() is not None for s in d.steps)  # every step stopped


def test_once_the_requeues_are_used_up_the_job_fails(tmp_path, scontrol):
    d = driver(tmp_path, restart_count=1)
    report_later(tmp_path)
    assert d.run() == 1
    assert not scontrol.exists()
    result = json.loads((tmp_path / "launch" / "result.json").read_text())
    assert result["state"] == "failed" and "learner rank 1 on n3" in result["cause"]


def test_a_rollout_report_does_not_end_the_job(tmp_path, scontrol):
    d = driver(tmp_path, restart_count=0)
    (tmp_path / "launch").mkdir(exist_ok=True)

    def later():
        time.sleep(1.0)
        (tmp_path / "launch" / "failed-rollout-n4.json").write_text(json.dumps({"time": time.time(), "code": 4}))
        time.sleep(1.5)
        d.cancel = True  # then scancel: the job stops without a failure

    threading.Thread(target=later, daemon=True).start()
    assert d.run() == 0 and not scontrol.exists()
    assert json.loads((tmp_path / "launch" / "result.json").read_text())["state"] == "stopped"


def test_a_rollout_whose_rewards_are_hopeless_ends_the_job_without_a_requeue(tmp_path, scontrol):
    """A rollout supervisor reports exit 4 of kind rewards_hopeless: every server shares the rewards, so the job
    ends as failed, naming it, and is not requeued (a requeue would fail the same way)."""
    d = driver(tmp_path, restart_count=0)
    (tmp_path / "launch").mkdir(exist_ok=True)
    record = {
        "time": time.time(),
        "kind": "rewards_hopeless",
        "role": "rollout",
        "child": "rollout-1",
        "host": "n4",
        "code": 4,
        "message": "",
        "log": "/logs/n4",
        "tail": "stopping: the rewards stopped working: the last 32 samples got no usable reward",
    }

    def later():
        time.sleep(1.0)
        (tmp_path / "launch" / "failed-rollout-n4.json").write_text(json.dumps(record))

    threading.Thread(target=later, daemon=True).start()
    t0 = time.monotonic()
    assert d.run() == 1
    assert time.monotonic() - t0 < 20 and not scontrol.exists()
    result = json.loads((tmp_path / "launch" / "result.json").read_text())
    assert result["state"] == "failed" and result["role"] == "rollout"
    assert result["cause"].startswith("rollout-1 on n4 exited with code 4: stopping: the rewards stopped working")
