"""The circuit breaker's rollback with two learner ranks under torchrun: every rank restores the same
healthy checkpoint and rewinds, they meet at the barrier, rank 0 alone has the broker discard, and
training goes on in step on both ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fleetrl.broker.client.sync import ZmqBrokerClient
from tests.conftest import free_port
from tests.helpers import BrokerProcess, write_job
from tests.learner.test_rollback import scripted_groups


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def two_ranks(job, broker_address: str, run_dir) -> subprocess.Popen:
    """A 2-rank learner under torchrun (one OpenMP thread each), output captured."""
    argv = ["-m", "fleetrl.app.learner", "--config", str(job), "--broker", broker_address, "--run-dir", str(run_dir)]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            *argv,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_two_ranks_roll_back_together(tmp_path, tiny_model_dir, arith_data):
    # 4 good steps (2 groups a step: one per rank), a collapse for 3 steps, then good again
    script = [0.75] * 4 + [0.0] * 3 + [0.75] * 16
    job = write_job(
        tmp_path,
        arith_data,
        model={"path": tiny_model_dir},
        broker={
            "max_staleness": 100,
            "queue_capacity": 10000,
            "vocab_size": 263,
            "accept_unleased": True,
            "commit_on_checkpoint": True,
        },
        learner={"groups_per_step": 2, "total_steps": 9, "lr": 1e-3, "device": "cpu"},
        sync={"transport": "filesystem", "keep_versions": 100},
        checkpoint={"interval": 2, "keep_last": 10},
        health={
            "healthy_window": 1,
            "max_rollbacks": 2,
            "rules": [
                {"name": "reward_drop", "action": "rollback", "window": 2, "threshold": 0.3},
                {"name": "non_finite", "action": "stop"},
            ],
        },
    )
    broker = BrokerProcess(job, tmp_path / "broker").start()
    learner = None
    try:
        rollout = ZmqBrokerClient(broker.address, "filler", "rollout")
        rollout.connect()
        acks = rollout.push_groups(scripted_groups(script))
        assert all(a.status == "accepted" for a in acks)
        rollout.close()
        run_dir = tmp_path / "run"
        learner = two_ranks(job, broker.address, run_dir)
        out, _ = learner.communicate(timeout=300)
        assert learner.returncode == 0, out[-4000:]
        rolled = [e for e in rows_of(run_dir / "events.jsonl") if e["rule"] == "rollback"]
        assert rolled and "healthy checkpoint at step 4" in rolled[0]["message"]
        # every rank rolled back as often, at the same steps, to the same checkpoints, with the same discard
        # (with commit_on_checkpoint the collapse's groups come back and are trained again: it may recur)
        per_rank = [
            [
                (r["rollback"], r["to_step"], r["discarded"])
                for r in rows_of(run_dir / f"trained-{rank}.jsonl")
                if "rollback" in r
            ]
            for rank in (0, 1)
        ]
        assert per_rank[0] == per_rank[1] and len(per_rank[0]) == len(rolled)
        assert per_rank[0][0][:2] == (6, 4)
        # and both trained on to the last step
        for rank in (0, 1):
            steps = [r["step"] for r in rows_of(run_dir / f"trained-{rank}.jsonl") if "step" in r]
            assert steps[-1] == 9
        # rank 0 alone asked the broker to discard the abandoned versions (once)
        log = (tmp_path / "broker" / "broker.log").read_text()
        assert log.count("control discard from learner-0") == len(rolled), log[-3000:]
        assert "control discard from learner-1" not in log
    finally:
        if learner is not None and learner.poll() is None:
            learner.kill()
            learner.wait()
        broker.stop()


@pytest.mark.slow
def test_two_ranks_end_on_a_checkpoint_step(tmp_path, tiny_model_dir, arith_data):
    # total_steps a multiple of checkpoint.interval: the last interval checkpoint is the final one. Rank 0
    # writes meta.json after the other rank has left the save, so a rank that judged "saved already?" from the
    # files on disk saved again on its own and waited in DeepSpeed's save barrier for a rank that had gone
    # (before the fix: rank 1 died with "Connection closed by peer", or the run hung)
    job = write_job(
        tmp_path,
        arith_data,
        model={"path": tiny_model_dir},
        broker={"max_staleness": 100, "queue_capacity": 10000, "vocab_size": 263, "accept_unleased": True},
        learner={"groups_per_step": 2, "total_steps": 4, "lr": 1e-4, "device": "cpu"},
        sync={"transport": "filesystem", "keep_versions": 100},
        checkpoint={"interval": 2, "keep_last": 10},
        health={"enabled": False},
    )
    broker = BrokerProcess(job, tmp_path / "broker").start()
    learner = None
    try:
        rollout = ZmqBrokerClient(broker.address, "filler", "rollout")
        rollout.connect()
        assert all(a.status == "accepted" for a in rollout.push_groups(scripted_groups([0.75] * 8)))
        rollout.close()
        run_dir = tmp_path / "run"
        learner = two_ranks(job, broker.address, run_dir)
        out, _ = learner.communicate(timeout=240)
        assert learner.returncode == 0, out[-4000:]
        saved = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step-*/meta.json"))
        assert saved == ["step-00000002", "step-00000004"]
        assert "final checkpoint step-00000004" in out, out[-4000:]
    finally:
        if learner is not None and learner.poll() is None:
            learner.kill()
            learner.wait()
        broker.stop()
