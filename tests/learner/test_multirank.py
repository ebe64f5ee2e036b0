"""Two learner ranks under torchrun (ZeRO-2 and ZeRO-3) train on leased groups; the weights they
broadcast over gloo reach a separately started receiver bit for bit."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fleetrl.broker.client.sync import ZmqBrokerClient
from tests.conftest import free_port
from tests.helpers import BrokerProcess, write_job
from tests.learner.conftest import synthetic_groups

HERE = Path(__file__).parent


# ZeRO-2 in the slow lane: stage 3 (gathered for the broadcast) is the one more likely to break, and each run
# costs ~24 s of make test
@pytest.mark.parametrize("zero_stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_two_ranks_train_and_broadcast_exact_weights(zero_stage, tmp_path, tiny_model_dir, arith_data):
    job = write_job(
        tmp_path,
        arith_data,
        model={"path": tiny_model_dir},
        broker={"max_staleness": 100, "queue_capacity": 10000, "vocab_size": 263, "accept_unleased": True},
        learner={"groups_per_step": 4, "total_steps": 2, "zero_stage": zero_stage, "lr": 1e-2, "device": "cpu"},
        sync={"transport": "gloo", "timeout_s": 60},
        checkpoint={"interval": 0},
    )
    broker = BrokerProcess(job, tmp_path / "broker").start()
    procs: list[subprocess.Popen] = []
    try:
        rollout = ZmqBrokerClient(broker.address, "filler", "rollout")
        rollout.connect()
        acks = rollout.push_groups(synthetic_groups(8, seed=3))
        assert all(a.status == "accepted" for a in acks)
        rollout.close()
        received = tmp_path / "received.safetensors"
        receiver = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "receiver_main.py"),
                "--broker",
                broker.address,
                "--config",
                str(job),
                "--model",
                tiny_model_dir,
                "--version",
                "2",
                "--out",
                str(received),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(receiver)
        assert receiver.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # a heartbeat lands: the learner expects this receiver in its rounds
        run_dir = tmp_path / "run"
        learner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "-m",
                "fleetrl.app.learner",
                "--config",
                str(job),
                "--broker",
                broker.address,
                "--run-dir",
                str(run_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        procs.append(learner)
        out, _ = learner.communicate(timeout=300)
        assert learner.returncode == 0, out[-4000:]
        assert receiver.wait(timeout=120) == 0
        final = sorted((run_dir / "checkpoints").glob("step-*/hf/model.safetensors"))[-1]
        learner_weights, got = load_file(final), load_file(received)
        assert set(got) <= set(learner_weights) and len(got) >= len(learner_weights) - 1  # lm_head tied
        for name, tensor in got.items():
            assert (tensor == learner_weights[name]).all(), name
        rows = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        assert len(rows) == 2 and '"sync/receivers": 1.0' in rows[-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        broker.stop()
