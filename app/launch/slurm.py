"""`fleetrl launch slurm`: render an sbatch job from the config and submit it.

    fleetrl launch slurm --config job.yaml [--dry-run] [KEY=VALUE ...]
    fleetrl launch slurm --add-rollout N --run RUN_DIR

Into ``RUN/launch/`` it writes ``job.sbatch`` (the script), ``plan.json`` (the steps the job driver starts)
and the resolved ``RUN/config.yaml``; ``--dry-run`` stops there and prints the script. The job asks for
the nodes the ``cluster:`` section names, in a fixed order (broker node, learner nodes, rollout nodes),
with ``--signal=B:USR1@<cluster.slurm.signal_s>`` and ``--requeue``. Inside the allocation the job driver
(``slurm_job.py``) starts one ``srun`` step per role — the per-node supervisor on each of the role's nodes —
and watches them.

``--add-rollout N`` submits N more rollout servers as a job of their own; they find the running job's
broker through ``RUN/launch/world.json`` and take server indices after the ones in use.
"""

from __future__ import annotations

import fcntl
import json
import math
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from fleetrl.app.launch.world import Layout
from fleetrl.common.config import ConfigError, dump_yaml, load_config
from fleetrl.common.config.cluster import check_placement
from fleetrl.common.config.schema import JobConfig

INSTALL_HINT = (
    "install the Slurm client tools on this machine (Debian/Ubuntu: apt-get install slurm-client; "
    "with the cluster's slurm.conf or SLURM_CONF) or run on a login node"
)


def resolve_run_dir(cfg: JobConfig, override: str | None = None) -> Path:
    """The run directory on shared storage: --run-dir > cluster.run_dir > run.dir > run.root/run.name."""
    path = override or cfg.cluster.run_dir or cfg.run.dir or str(Path(cfg.run.root) / cfg.run.name)
    return Path(path).resolve()


def _times(gb: int | None, n: int) -> int | None:
    return None if gb is None else gb * n


def role_request(cfg: JobConfig, layout: Layout, role: str) -> dict[str, int | None]:
    """What one node of ``role`` needs: GPUs, CPU cores (its one supervisor task's) and memory in GiB (None = not
    set: no ``--mem``, so Slurm gives the partition's default; the broker never sets one)."""
    c = cfg.cluster
    if role == "learner":
        return {
            "gpus": c.learner.gpus_per_node,
            "cpus": c.learner.cpus_per_rank * layout.ranks_per_node,
            "mem_gb": _times(c.learner.mem_gb_per_rank, layout.ranks_per_node),
        }
    if role == "rollout":
        servers = max(1, layout.servers_per_node)
        return {
            "gpus": c.rollout.gpus_per_node,
            "cpus": max(1, c.rollout.cpus_per_server * servers),
            "mem_gb": _times(c.rollout.mem_gb_per_server, servers),
        }
    return {"gpus": 0, "cpus": 1, "mem_gb": None}


def step_options(request: dict[str, int | None]) -> list[str]:
    """The srun options of one role's step: its own GPUs (none for the broker), cores and memory (when set)."""
    opts = [f"--gpus-per-node={request['gpus']}"] if request["gpus"] else []
    opts += [f"--cpus-per-task={request['cpus']}"]
    return [*opts, f"--mem={request['mem_gb']}G"] if request["mem_gb"] else opts


def role_steps(cfg: JobConfig, layout: Layout) -> list[dict]:
    """The job's srun steps in start order: the broker, the learner nodes, the rollout nodes, each with the
    srun options of what its role needs (``options``)."""
    steps = [{"role": "learner", "nodes": layout.learner_nodes}]
    if cfg.needs_fleet:
        steps = [{"role": "broker", "nodes": 1}, *steps, {"role": "rollout", "nodes": layout.rollout_nodes}]
    return [{**s, "options": step_options(role_request(cfg, layout, s["role"]))} for s in steps if s["nodes"] > 0]


def sbatch_options(
    cfg: JobConfig, layout: Layout, run_dir: Path, nodes: int, name: str, requeue: bool, steps: list[dict] | None = None
) -> list[str]:
    """The allocation: one task per node with the most any role on a node needs; roles without GPUs (the
    broker) do not raise the GPU count. Each srun step then asks for its own role's share (`step_options`)."""
    c = cfg.cluster
    steps = role_steps(cfg, layout) if steps is None else steps
    needs = [role_request(cfg, layout, s["role"]) for s in steps]
    gpus = max((n["gpus"] for n in needs), default=0)
    opts = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--time={c.time_limit}",
        f"--output={run_dir}/launch/slurm-%j.out",
        "--open-mode=append",
    ]
    opts += [f"--partition={c.partition}"] if c.partition else []
    opts += [f"--account={c.account}"] if c.account else []
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += [f"--cpus-per-task={max(n['cpus'] for n in needs)}"]
    mem = max((n["mem_gb"] for n in needs if n["mem_gb"]), default=None)
    opts += [f"--mem={mem}G"] if mem else []
    opts += ["--exclusive"] if c.slurm.exclusive else []
    if requeue:
        opts += [f"--signal=B:USR1@{c.slurm.signal_s}", "--requeue" if c.slurm.requeue else "--no-requeue"]
    return opts + list(c.slurm.extra_args)


def srun_prefix(cfg: JobConfig, run_dir: Path) -> list[str]:
    """What every step's srun gets besides its node list: overlapping steps, a container when one is set."""
    prefix = ["srun", "--overlap", "--kill-on-bad-exit=0", "--ntasks-per-node=1"]
    if cfg.cluster.image:
        prefix += [f"--container-image={cfg.cluster.image}", f"--container-mounts={run_dir}:{run_dir}"]
    return prefix


def build_plan(
    cfg: JobConfig,
    run_dir: Path,
    config_path: Path,
    python: str,
    steps: list[dict],
    env: dict[str, str] | None = None,
    kind: str = "job",
) -> dict:
    layout = Layout.from_config(cfg, str(run_dir))
    return {
        "kind": kind,
        "run_dir": str(run_dir),
        "config": str(config_path),
        "python": python,
        "layout": asdict(layout),
        "steps": steps,
        "srun": srun_prefix(cfg, run_dir),
        "env": env or {},
        "requeue": kind == "job" and cfg.cluster.slurm.requeue,
    }


def render_script(options: list[str], plan: dict, plan_path: Path) -> str:
    """The sbatch script: options, then the job driver, which starts and watches the steps listed below."""
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in options),
        "",
        f"# fleetrl {plan['kind']} for {plan['run_dir']}: rendered by `fleetrl launch slurm`; plan in {plan_path}.",
        "# The job driver starts one srun step per role (the per-node supervisor on each of the role's nodes):",
    ]
    sup = [
        plan["python"],
        "-m",
        "fleetrl.app.launch.supervisor",
        "--config",
        plan["config"],
        "--run-dir",
        plan["run_dir"],
    ]
    for step in plan["steps"]:
        argv = [
            *plan["srun"],
            *step.get("options", []),
            f"--nodes={step['nodes']}",
            f"--ntasks={step['nodes']}",
            f"--nodelist=<{step['role']} nodes>",
            f"--job-name=fleetrl-{step['role']}",
            *sup,
            "--role",
            step["role"],
        ]
        lines.append(f"#   {shlex.join(argv)}")
    lines += [
        "# It ends the job when the learner finishes, fails it naming the cause when the broker or a learner",
        "# rank dies, and turns the walltime warning (SIGUSR1) into checkpoint -> clean exit -> requeue.",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(plan['run_dir'])}/launch",
        *(f"export {k}={shlex.quote(v)}" for k, v in plan["env"].items()),
        f"exec {shlex.quote(plan['python'])} -m fleetrl.app.launch.slurm_job {shlex.quote(str(plan_path))}",
        "",
    ]
    return "\n".join(lines)


def prepare(cfg: JobConfig, run_dir: Path) -> tuple[Path, str]:
    """Write the resolved config into the run directory; return its path and the nodes' python."""
    check_placement(cfg)
    (run_dir / "launch").mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_yaml(cfg))
    return config_path, cfg.cluster.python or sys.executable


def render_job(cfg: JobConfig, run_dir: Path) -> tuple[Path, str]:
    """Render the main job into RUN/launch/; returns (script path, script text)."""
    config_path, python = prepare(cfg, run_dir)
    layout = Layout.from_config(cfg, str(run_dir))
    plan = build_plan(cfg, run_dir, config_path, python, role_steps(cfg, layout))
    opts = sbatch_options(cfg, layout, run_dir, layout.nodes_needed(), f"fleetrl-{cfg.run.name}", requeue=True)
    return _write(run_dir, "job", plan, opts)


def _write(run_dir: Path, stem: str, plan: dict, opts: list[str]) -> tuple[Path, str]:
    plan_path = run_dir / "launch" / f"{stem}.plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    script = render_script(opts, plan, plan_path)
    path = run_dir / "launch" / f"{stem}.sbatch"
    path.write_text(script)
    return path, script


def next_rollout_indices(run_dir: Path, count: int, base_servers: int) -> int:
    """Reserve ``count`` server indices after those in use (file-locked); returns the first."""
    path = run_dir / "launch" / "rollout-index.json"
    with (run_dir / "launch" / ".rollout-index.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        first = json.loads(path.read_text())["next"] if path.exists() else base_servers
        path.write_text(json.dumps({"next": first + count}))
    return first


def render_add_rollout(run_dir: Path, count: int, overrides: list[str]) -> tuple[Path, str]:
    """Render a job of ``count`` rollout servers that join the fleet of the job in ``run_dir``."""
    world_path = run_dir / "launch" / "world.json"
    if not world_path.exists():
        raise ConfigError(
            f"{run_dir} has no running job (no launch/world.json yet): submit it with "
            "`fleetrl launch slurm --config JOB`, and add rollouts once squeue shows it running"
        )
    world = json.loads(world_path.read_text())
    config_path = run_dir / "config.yaml"
    cfg = load_config(config_path, overrides)
    layout = Layout.from_config(cfg, str(run_dir))
    first = next_rollout_indices(run_dir, count, layout.num_servers)
    nodes = math.ceil(count / layout.servers_per_node)
    env = {
        "FLEETRL_BROKER_ADDRESS": world["broker_address"],
        "FLEETRL_SYNC_ADDR": world["sync_address"],
        "FLEETRL_ROLLOUT_OFFSET": str(first),
        "FLEETRL_ROLLOUT_SERVERS": str(count),
    }
    python = cfg.cluster.python or sys.executable
    steps = [{"role": "rollout", "nodes": nodes, "options": step_options(role_request(cfg, layout, "rollout"))}]
    plan = build_plan(cfg, run_dir, config_path, python, steps, env, "add-rollout")
    opts = sbatch_options(
        cfg, layout, run_dir, nodes, f"fleetrl-{cfg.run.name}-rollout+{count}", requeue=False, steps=steps
    )
    return _write(run_dir, f"add-rollout-{first}", plan, opts)


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError(f"`sbatch` is not on PATH; {INSTALL_HINT}")
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def main(args) -> int:
    if args.add_rollout is not None:
        if not args.run:
            raise ConfigError("--add-rollout N needs --run RUN_DIR (the run directory of the job to join)")
        if args.add_rollout < 1:
            raise ConfigError(f"--add-rollout {args.add_rollout}: add at least 1 rollout server")
        path, script = render_add_rollout(Path(args.run).resolve(), args.add_rollout, list(args.overrides))
    else:
        if not args.config:
            raise ConfigError("fleetrl launch slurm needs --config JOB.yaml (or --add-rollout N --run RUN_DIR)")
        cfg = load_config(args.config, list(args.overrides))
        path, script = render_job(cfg, resolve_run_dir(cfg, args.run_dir))
    if args.dry_run:
        print(script)
        print(f"# dry run: wrote {path} and {path.with_suffix('.plan.json')}; submitted nothing", flush=True)
        return 0
    job_id = submit(path)
    print(
        f"fleetrl launch slurm: submitted job {job_id} ({path}); output in {path.parent}/slurm-{job_id}.out", flush=True
    )
    return 0
