"""The rollout server's CPU per generated sample: the demo's rollout against a real broker, without a learner.

Starts `fleetrl broker` and `fleetrl rollout` (configs/demo.yaml on the demo's warm start, one torch thread
as `fleetrl run` gives it) as processes of their own. This driver plays the consuming half of a learner: it
leases every group the broker holds and acknowledges it at once (no training, no new weights), so the rollout
generates as fast as it can within the admission window. After ``--warmup`` seconds it reads the rollout
process's CPU time and counts the samples it leased over ``--seconds``:

- ``rollout_cpu_ms_per_sample``: the rollout process's CPU milliseconds per generated sample (the figure of
  merit: on a shared box wall-clock rates move with the others' load, CPU per unit of work much less);
- the rollout's cores busy, generated samples/s, the broker's CPU, others' CPU share.

It is the rollout's pipeline alone (engine, episodes, assembly, rewards, push): no weight loads, no
throttling by a slow learner. Interleave trees on one box (A B A B):

    python benchmarks/rollout_cpu.py --label B
    python benchmarks/rollout_cpu.py --label A --pythonpath DIR    # another tree's code (see overlap.py)

Saves benchmarks/results/rollout_cpu-<label>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BUSY_SHARE, ROOT, prepare  # noqa: E402

from fleetrl.common.telemetry.cpu import machine_busy_s, others_cpu_share  # noqa: E402


def cli_module(pythonpath: str | None) -> str:
    """The CLI's module in the tree that runs: a tree from before the re-floor (issue 25) has it in common/."""
    if pythonpath and not (Path(pythonpath) / "fleetrl" / "app" / "cli.py").exists():
        return "fleetrl.common.cli"
    return "fleetrl.app.cli"


def start(role: str, argv: list[str], run_dir: Path, env: dict, cli: str) -> subprocess.Popen:
    log = (run_dir / f"{role}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", cli, *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )


def wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear (exit {proc.poll()}); see the logs in {path.parent}")
        time.sleep(0.1)


def drain(client, until: float, step: list[int]) -> int:
    """Lease and acknowledge every group until ``until``; returns the samples taken."""
    from fleetrl.common import messages as m

    samples = 0
    while time.monotonic() < until:
        lease = client.lease_batch(256, wait_s=0.2)
        if isinstance(lease, m.BatchLease) and lease.groups:
            step[0] += 1
            client.ack_batch(lease.lease_id, [g.group_id for g in lease.groups], step[0])
            samples += sum(g.num_responses for g in lease.groups)
        elif not isinstance(lease, m.BatchLease):
            time.sleep(min(0.2, lease.retry_after_s))
    return samples


def cpu_s(proc: subprocess.Popen) -> float:
    t = psutil.Process(proc.pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--label", default="after")
    ap.add_argument(
        "--pythonpath", help="run another tree's fleetrl (a dir holding fleetrl/{common,broker,rollout,learner})"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    ap.add_argument("--workdir", default=str(ROOT), help="where models/demo-warm and data/ are (default: the checkout)")
    args = ap.parse_args()
    work = prepare(Path(args.workdir), 0.25)
    run_dir = ROOT / "runs" / f"rollout_cpu-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True)
    overrides = [f"model.path={work['warm']}", f"data.train={work['train']}", f"data.eval={work['eval']}", *args.set]
    job = ["--config", str(ROOT / "configs" / "demo.yaml"), "--run-dir", str(run_dir)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "FLEETRL_CHILD": "1",
    }
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([args.pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cli = cli_module(args.pythonpath)
    procs: list[subprocess.Popen] = []
    client = None
    try:
        procs.append(start("broker", ["broker", *job, *overrides], run_dir, env, cli))
        wait_file(run_dir / "broker.json", procs[0], 120)
        procs.append(start("rollout", ["rollout", *job, "--server-index", "0", *overrides], run_dir, env, cli))
        wait_file(run_dir / "rollout-0.ready", procs[1], 300)
        from fleetrl.broker.client.sync import ZmqBrokerClient

        client = ZmqBrokerClient(
            json.loads((run_dir / "broker.json").read_text())["address"], "learner-bench", "learner"
        )
        client.connect()
        step = [0]
        drain(client, time.monotonic() + args.warmup, step)
        busy0, driver0, t0 = machine_busy_s(), time.process_time(), time.monotonic()
        r0, b0 = cpu_s(procs[1]), cpu_s(procs[0])
        samples = drain(client, t0 + args.seconds, step)
        wall = time.monotonic() - t0
        rollout, broker = cpu_s(procs[1]) - r0, cpu_s(procs[0]) - b0
        busy, driver = machine_busy_s() - busy0, time.process_time() - driver0  # the driver's lease loop: not others'
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    cores = os.cpu_count() or 1
    result = {
        "label": args.label,
        "pythonpath": args.pythonpath,
        "overrides": overrides,
        "run_dir": str(run_dir),
        "seconds": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "rollout_cpu_ms_per_sample": 1000 * rollout / max(samples, 1),
        "rollout_cores": rollout / wall,
        "broker_cores": broker / wall,
        "others_cpu_share": others_cpu_share(busy, rollout + broker + driver, wall, cores),
    }
    result["comparable"] = result["others_cpu_share"] <= BUSY_SHARE
    out = ROOT / "benchmarks" / "results" / f"rollout_cpu-{args.label}.json"
    out.write_text(json.dumps(result, indent=1))
    print(
        f"{args.label}: rollout {result['rollout_cpu_ms_per_sample']:.3f} CPU-ms per generated sample "
        f"({result['rollout_cores']:.2f} cores, {result['samples_per_s']:.0f} samples/s, broker "
        f"{result['broker_cores']:.2f} cores); others' CPU share {100 * result['others_cpu_share']:.0f}%"
        f"{'' if result['comparable'] else ' (BUSY: wall-clock rates not comparable)'}"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
