"""`fleetrl launch slurm`: the rendered sbatch job, its plan, the driver's srun steps, --add-rollout, and
refusals at --dry-run (bad placement, missing sbatch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.app.launch.slurm import render_add_rollout, render_job, submit
from fleetrl.app.launch.slurm_job import Driver
from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.config.cluster import check_placement, placement_errors, time_limit_s

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "configs" / "demo.yaml")
GPU_JOB = [
    "learner.num_ranks=16",
    "cluster.learner.nodes=2",
    "cluster.learner.gpus_per_node=8",
    "rollout.engine=vllm",
    "rollout.vllm.tensor_parallel_size=2",
    "cluster.rollout.nodes=3",
    "cluster.rollout.gpus_per_node=8",
    "cluster.partition=gpu",
    "cluster.account=rl",
    "cluster.time_limit=1-00:00:00",
    "cluster.slurm.signal_s=600",
    "learner.device=cuda",
    "cluster.image=nvcr.io/x/fleetrl:1",
]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", *args], capture_output=True, text=True, env=env or os.environ
    )


def test_gpu_job_script_and_plan(tmp_path):
    cfg = load_config(None, GPU_JOB)
    path, script = render_job(cfg, tmp_path)
    assert path == tmp_path / "launch" / "job.sbatch"
    for option in (
        "--nodes=5",
        "--ntasks-per-node=1",
        "--time=1-00:00:00",
        "--partition=gpu",
        "--account=rl",
        "--gpus-per-node=8",
        "--signal=B:USR1@600",
        "--requeue",
        "--exclusive",
        f"--output={tmp_path}/launch/slurm-%j.out",
    ):
        assert f"#SBATCH {option}\n" in script
    assert f"-m fleetrl.app.launch.slurm_job {tmp_path}/launch/job.plan.json" in script
    plan = json.loads((tmp_path / "launch" / "job.plan.json").read_text())
    assert [(s["role"], s["nodes"]) for s in plan["steps"]] == [("broker", 1), ("learner", 2), ("rollout", 3)]
    assert "--container-image=nvcr.io/x/fleetrl:1" in plan["srun"]
    assert plan["layout"]["servers_per_node"] == 4 and plan["layout"]["gpus_per_server"] == 2
    assert load_config(tmp_path / "config.yaml").cluster.learner.nodes == 2  # the resolved config travels along
    driver = Driver(plan, {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "g[1-5]"})
    argv = {s.role: s.argv for s in driver.steps}
    assert "--nodelist=g1" in argv["broker"] and "--nodelist=g1,g2" in argv["learner"]
    assert "--nodelist=g3,g4,g5" in argv["rollout"] and "--ntasks=3" in argv["rollout"]
    assert argv["rollout"][-6:] == [
        "--role",
        "rollout",
        "--config",
        str(tmp_path / "config.yaml"),
        "--run-dir",
        str(tmp_path),
    ]


def test_dry_run_writes_and_submits_nothing(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no sbatch anywhere: a dry run must not need it
    out = cli("launch", "slurm", "--config", DEMO, "--run-dir", str(tmp_path), "--dry-run", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=fleetrl-demo")
    assert "submitted nothing" in out.stdout
    assert (tmp_path / "launch" / "job.sbatch").exists() and (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["learner.num_ranks=16", "cluster.learner.gpus_per_node=8"], "learner.num_ranks=16"),
        (["cluster.base_port=45000"], "cluster.base_port=45000"),
        (["cluster.base_port=80"], "cluster.base_port=80"),
        (["rollout.engine=vllm"], "cluster.rollout.gpus_per_node=0"),
        (
            ["cluster.rollout.gpus_per_node=4", "rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=8"],
            "rollout.vllm.tensor_parallel_size=8",
        ),
        (
            ["cluster.rollout.gpus_per_node=4", "cluster.rollout.servers_per_node=8"],
            "cluster.rollout.servers_per_node=8",
        ),
        (["cluster.time_limit=4"], "cluster.slurm.signal_s=300"),
        (["cluster.time_limit=tomorrow"], "cluster.time_limit='tomorrow'"),
        (["cluster.rollout.nodes=0"], "cluster.rollout.nodes=0"),
        (["learner.device=cuda"], "cluster.learner.gpus_per_node=0"),
    ],
)
def test_unplaceable_sections_are_refused_naming_the_key(overrides, key):
    cfg = load_config(None, overrides)
    errors = placement_errors(cfg, ephemeral=(32768, 60999))
    assert any(key in e for e in errors), errors
    with pytest.raises(ConfigError, match="cannot be placed"):
        check_placement(cfg)


def test_dry_run_refuses_an_ephemeral_port(tmp_path):
    out = cli("launch", "slurm", "--config", DEMO, "--run-dir", str(tmp_path), "--dry-run", "cluster.base_port=50000")
    assert out.returncode == 2
    assert "cluster.base_port=50000" in out.stderr and "ephemeral" in out.stderr
    assert not (tmp_path / "launch" / "job.sbatch").exists()


def test_the_defaults_can_be_placed():
    assert placement_errors(load_config(DEMO), ephemeral=(32768, 60999)) == []


def test_time_limits():
    assert [time_limit_s(t) for t in ("30", "10:30", "01:00:00", "2-3", "2-03:04", "2-03:04:05", 5)] == [
        1800,
        630,
        3600,
        183600,
        183840,
        183845,
        300,
    ]


def test_missing_sbatch_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="`sbatch` is not on PATH; install the Slurm client tools"):
        submit(tmp_path / "job.sbatch")


def test_add_rollout_takes_the_next_indices_and_the_running_broker(tmp_path):
    cfg = load_config(DEMO, ["cluster.rollout.servers_per_node=2", "cluster.rollout.nodes=2"])
    render_job(cfg, tmp_path)
    with pytest.raises(ConfigError, match="no running job"):
        render_add_rollout(tmp_path, 3, [])
    (tmp_path / "launch" / "world.json").write_text(
        json.dumps({"broker_address": "tcp://n1:29500", "sync_address": "n2:29503"})
    )
    path, script = render_add_rollout(tmp_path, 3, [])
    assert "#SBATCH --nodes=2\n" in script and "--signal" not in script and "--requeue" not in script
    assert "export FLEETRL_BROKER_ADDRESS=tcp://n1:29500" in script and "export FLEETRL_ROLLOUT_OFFSET=4" in script
    _, again = render_add_rollout(tmp_path, 1, [])
    assert "export FLEETRL_ROLLOUT_OFFSET=7" in again and "export FLEETRL_ROLLOUT_SERVERS=1" in again
    plan = json.loads(path.with_suffix(".plan.json").read_text())
    driver = Driver(plan, {"SLURM_JOB_ID": "10", "SLURM_JOB_NODELIST": "x[1-2]"})
    assert [s.role for s in driver.steps] == ["rollout"] and "--nodelist=x1,x2" in driver.steps[0].argv
    assert [p.name for p in driver.ready_files()] == ["rollout-4.ready", "rollout-5.ready", "rollout-6.ready"]


def test_add_rollout_needs_a_run_dir():
    out = cli("launch", "slurm", "--add-rollout", "2")
    assert out.returncode == 2 and "--add-rollout N needs --run RUN_DIR" in out.stderr


def test_each_role_asks_for_what_it_needs(tmp_path):
    cfg = load_config(
        None,
        [
            *GPU_JOB,
            "cluster.rollout.gpus_per_node=4",
            "cluster.learner.cpus_per_rank=6",
            "cluster.learner.mem_gb_per_rank=40",
            "cluster.rollout.cpus_per_server=3",
            "cluster.rollout.mem_gb_per_server=20",
            "cluster.slurm.broker_own_node=true",
        ],
    )
    _, script = render_job(cfg, tmp_path)
    # the allocation: the most one node needs: 8 learner ranks x 6 cores / x 40 GiB; the broker adds no GPUs
    for option in ("--gpus-per-node=8", "--cpus-per-task=48", "--mem=320G"):
        assert f"#SBATCH {option}\n" in script
    plan = json.loads((tmp_path / "launch" / "job.plan.json").read_text())
    argv = {s.role: s.argv for s in Driver(plan, {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "g[1-6]"}).steps}
    assert not any(a.startswith("--gpus") for a in argv["broker"])  # the CPU-only broker books no GPU
    assert "--cpus-per-task=1" in argv["broker"] and not any(a.startswith("--mem") for a in argv["broker"])
    assert {"--gpus-per-node=8", "--cpus-per-task=48", "--mem=320G"} <= set(argv["learner"])
    # 4 GPUs per rollout node, tensor-parallel 2: 2 servers x 3 cores / x 20 GiB
    assert {"--gpus-per-node=4", "--cpus-per-task=6", "--mem=40G"} <= set(argv["rollout"])
    for role in argv:  # the script's srun lines say the same as the driver's
        line = next(ln for ln in script.splitlines() if ln.startswith("#   srun") and f"--role {role}" in ln)
        assert all(o in line.split() for o in argv[role] if o.startswith(("--gpus", "--cpus", "--mem")))


def test_memory_is_asked_for_only_when_set(tmp_path):
    """By default no --mem anywhere (a fixed figure would leave the job pending on smaller nodes); one role's
    setting sizes the allocation and that role's step only."""
    _, script = render_job(load_config(None, GPU_JOB), tmp_path / "a")
    plan = json.loads((tmp_path / "a" / "launch" / "job.plan.json").read_text())
    assert "--mem" not in script and not any(o.startswith("--mem") for s in plan["steps"] for o in s["options"])
    _, script = render_job(load_config(None, [*GPU_JOB, "cluster.rollout.mem_gb_per_server=10"]), tmp_path / "b")
    plan = json.loads((tmp_path / "b" / "launch" / "job.plan.json").read_text())
    assert "#SBATCH --mem=40G\n" in script  # 4 servers per node (tensor-parallel 2 on 8 GPUs) x 10 GiB
    mem = {s["role"]: [o for o in s["options"] if o.startswith("--mem")] for s in plan["steps"]}
    assert mem == {"broker": [], "learner": [], "rollout": ["--mem=40G"]}


def test_the_cluster_lane_job_fits_its_one_two_core_node(tmp_path):
    """tests/cluster/job.yaml as `make test-cluster` submits it: all roles share one 2-core node, so the
    allocation asks for at most 2 cores and no memory figure."""
    cfg = load_config(ROOT / "tests" / "cluster" / "job.yaml")
    _, script = render_job(cfg, tmp_path)
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --cpus-per-task=2\n" in script
    assert "--mem" not in script and "--gpus" not in script
