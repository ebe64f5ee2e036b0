"""How a run stops and how the fleet shrinks: Ctrl-C under a pseudo-terminal, and a rollout that leaves.

    python benchmarks/lifecycle.py [--workdir /tmp/fleetrl-lifecycle]

(a) `fleetrl run` (tiny model, gloo) under a pty; after 5 learner steps ^C is written to the terminal,
    so the kernel sends SIGINT to the foreground process group. Reports the exit code, the seconds
    until every process stopped and the launcher's one line per process.
(b) a run with two rollout servers and `broker.client_timeout_s=60`; one rollout is SIGTERMed after 15
    steps. Reports seconds per step, `sync/receivers` and `fleet/servers` before and after: a rollout
    that leaves is out of the fleet at the next step, not after the 60 s timeout.

Prints and saves benchmarks/results/lifecycle.json, with the machine's CPU load during each part.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import RunProcess, job_args, read_jsonl, wait_for  # noqa: E402
from tests.e2e.test_lifecycle import TerminalRun  # noqa: E402


def build(workdir: Path) -> tuple[str, str]:
    """A tiny model and the arithmetic task, built locally (no hub)."""
    model, data = workdir / "tiny", workdir / "arith.jsonl"
    cli = [sys.executable, "-m", "fleetrl.app.cli"]
    if not (model / "config.json").exists():
        subprocess.run([*cli, "init-model", "--out", str(model), "--preset", "tiny"], check=True)
    if not data.exists():
        subprocess.run(
            [*cli, "init-data", "--task", "arithmetic", "--out", str(data), "--n", "2000", "--eval-n", "50"], check=True
        )
    return str(model), str(data)


def ctrl_c(workdir: Path, cfg: Path, model: str, data: str) -> dict:
    run_dir = workdir / "ctrlc"
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        str(cfg),
        "--run-dir",
        str(run_dir),
        *job_args(model, data, "learner.total_steps=100000", "checkpoint.interval=0", "sync.transport=gloo"),
    ]
    run = TerminalRun(argv)
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 5, 300, "5 learner steps")
        load = psutil.cpu_percent(interval=1.0)
        t0 = time.monotonic()
        run.ctrl_c()
        code = run.wait(200)
        stop_s = time.monotonic() - t0
    finally:
        run.kill()
    lines = [line for line in run.text().splitlines() if line.startswith("fleetrl run:") and "exit" in line]
    return {"exit_code": code, "stop_s": round(stop_s, 2), "cpu_busy_pct": load, "lines": lines}


def leave(workdir: Path, cfg: Path, model: str, data: str) -> dict:
    run_dir = workdir / "leave"
    run = RunProcess(
        run_dir,
        str(cfg),
        job_args(
            model,
            data,
            "learner.total_steps=100000",
            "checkpoint.interval=0",
            "sync.transport=gloo",
            "rollout.num_servers=2",
            "broker.client_timeout_s=60",
        ),
    )
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 15, 300, "15 learner steps")
        pid = json.loads((run_dir / "rollout-1.ready").read_text())["pid"]
        n0 = len(read_jsonl(run_dir / "metrics.jsonl"))
        os.kill(pid, signal.SIGTERM)
        psutil.Process(pid).wait(60)
        n1 = len(read_jsonl(run_dir / "metrics.jsonl"))
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= n1 + 30, 300, "30 more steps")
        load = psutil.cpu_percent(interval=1.0)
    finally:
        run.stop()
    rows = read_jsonl(run_dir / "metrics.jsonl")

    def summary(part: list[dict]) -> dict:
        return {
            "s_per_step": round((part[-1]["time"] - part[0]["time"]) / max(1, len(part) - 1), 3),
            "sync_s_max": round(max(r["timing/sync_s"] for r in part), 3),
            "receivers": sorted({r["sync/receivers"] for r in part}),
            "fleet_servers": sorted({r["fleet/servers"] for r in part if "fleet/servers" in r}),
        }

    return {"before": summary(rows[5:n0]), "after": summary(rows[n1 + 1 : n1 + 31]), "cpu_busy_pct": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/fleetrl-lifecycle")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lifecycle.json"))
    args = ap.parse_args()
    workdir = Path(args.workdir)
    for part in ("ctrlc", "leave"):
        subprocess.run(["rm", "-rf", str(workdir / part)], check=True)
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, data = build(workdir)
    cfg = workdir / "empty.yaml"
    cfg.write_text("{}\n")
    result = {"ctrl_c": ctrl_c(workdir, cfg, model, data), "leave": leave(workdir, cfg, model, data)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
