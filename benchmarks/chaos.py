"""Chaos run: SIGKILL a rollout server, the broker and the learner during a `fleetrl run`, then prove
from the spool, the checkpoints and the logs that nothing acknowledged was lost or trained twice.

    python benchmarks/chaos.py [--steps 40] [--kills rollout-0@8,broker@16,learner@24] [--workdir DIR]

The job: the tiny model, `broker.spool_dir` and `broker.commit_on_checkpoint` on, checkpoints every
4 steps, `run.restart_policy: on-failure` (the launcher restarts what dies, as a supervisor would: the
broker on its old ports from its spool, the learner from its newest checkpoint). A controller kills
the named process once the learner has logged the given step. Afterwards:

- acknowledged = every group id a rollout server got an `accepted` ack for (rollout-*.acked.jsonl);
- trained = the group ids of every learner step that survived (trained-*.jsonl, cut at each resume:
  steps after the checkpoint a restarted learner resumed from were rolled back and replayed);
- queued = the groups the spool still holds after the run (recovered from its segments).

Reported: kills survived, groups acknowledged, lost (acknowledged, neither trained nor queued: must
be 0), duplicated (trained twice in the surviving timeline: must be 0), whether policy versions never
went backwards, whether the run reached its last step, and the time to recover from each kill (kill
-> the next learner step). Figures go to stdout and benchmarks/results/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a SIGKILL
    return rows


def job_overrides(workdir: Path, steps: int) -> list[str]:
    return [
        f"model.path={workdir / 'tiny'}",
        f"data.train={workdir / 'data.jsonl'}",
        "rollout.group_size=4",
        "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=4",
        "rollout.rewards=[{name: exact}]",
        "rollout.device=cpu",
        "learner.device=cpu",
        "learner.groups_per_step=4",
        f"learner.total_steps={steps}",
        "learner.lr=1e-3",
        "learner.batch_wait_s=300",
        "sync.transport=filesystem",
        "checkpoint.interval=4",
        "checkpoint.keep_last=3",
        f"broker.spool_dir={workdir / 'spool'}",
        "broker.commit_on_checkpoint=true",
        "broker.max_staleness=1000",
        "broker.queue_capacity=40",
        "broker.fsync=never",
        "broker.prompt_lease_s=20",
        "broker.client_timeout_s=6",
        "broker.batch_lease_s=60",
        "broker.request_timeout_s=5",
        "run.restart_policy=on-failure",
        "run.max_restarts=3",
        "run.ready_timeout_s=300",
        "health.enabled=false",
    ]


def pid_of(run_dir: Path, name: str) -> int | None:
    file = run_dir / ("broker.json" if name == "broker" else f"{name}.ready")
    try:
        return int(json.loads(file.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def last_step(run_dir: Path) -> tuple[int, float]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return (rows[-1]["step"], rows[-1]["time"]) if rows else (0, 0.0)


def control(run_dir: Path, proc: subprocess.Popen, kills: list[tuple[str, int]], deadline: float) -> list[dict]:
    """Kill each named process once the learner passed its step; time until the next learner step."""
    done = []
    for name, at_step in kills:
        while last_step(run_dir)[0] < at_step:
            if proc.poll() is not None or time.monotonic() > deadline:
                return done
            time.sleep(0.2)
        pid = pid_of(run_dir, name)
        if pid is None:
            continue
        rows_before = len(read_jsonl(run_dir / "metrics.jsonl"))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        print(f"chaos: SIGKILL {name} (pid {pid}) after step {at_step}", flush=True)
        recovered = None
        while time.monotonic() < deadline:
            exited = proc.poll() is not None  # read before the rows: a run that ends right after recovering counts
            rows = read_jsonl(run_dir / "metrics.jsonl")
            later = [r for r in rows[rows_before:] if r["time"] > killed_at]
            if later and pid_of(run_dir, name) not in (None, pid):
                recovered = later[0]["time"] - killed_at
                break
            if exited:
                break
            time.sleep(0.2)
        done.append({"killed": name, "after_step": at_step, "pid": pid, "recover_s": recovered})
        print(f"chaos: recovered from the {name} kill in {recovered} s", flush=True)
    return done


def surviving_trained(run_dir: Path) -> list[str]:
    """Group ids trained in the surviving timeline: a resume at step s voids earlier entries after s."""
    trained: list[str] = []
    for path in sorted(run_dir.glob("trained-*.jsonl")):
        steps: dict[int, list[str]] = {}
        for row in read_jsonl(path):
            if "resume" in row:
                steps = {s: ids for s, ids in steps.items() if s <= row["resume"]}
            else:
                steps[row["step"]] = row["group_ids"]
        for ids in steps.values():
            trained.extend(ids)
    return trained


def check(run_dir: Path, spool_dir: Path, total_steps: int) -> dict:
    from fleetrl.broker.server.spool import Spool

    acked = {
        gid for path in run_dir.glob("rollout-*.acked.jsonl") for row in read_jsonl(path) for gid in row["group_ids"]
    }
    trained = surviving_trained(run_dir)
    queued = set(Spool(spool_dir, fsync="never").recover().groups)
    counts = Counter(trained)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    versions = [r["policy/version"] for r in rows]
    rollbacks = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("rule") == "rollback"]
    backwards = sum(1 for a, b in zip(versions, versions[1:]) if b < a)
    return {
        "acknowledged": len(acked),
        "trained": len(set(trained)),
        "still_queued": len(queued),
        "lost": len(acked - set(trained) - queued),
        "duplicated": sum(1 for c in counts.values() if c > 1),
        "trained_not_acknowledged": len(set(trained) - acked),
        "versions_monotonic": backwards == 0 or backwards <= len(rollbacks),
        "reached_final_step": bool(rows) and rows[-1]["step"] >= total_steps,
        "restarts": [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "restart"],
    }


def prepare(workdir: Path) -> None:
    py = [sys.executable, "-m", "fleetrl.app.cli"]
    if not (workdir / "tiny" / "config.json").exists():
        subprocess.run(
            [*py, "init-model", "--out", str(workdir / "tiny"), "--preset", "tiny"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if not (workdir / "data.jsonl").exists():
        subprocess.run(
            [*py, "init-data", "--out", str(workdir / "data.jsonl"), "--n", "5000", "--eval-n", "100"],
            check=True,
            stdout=subprocess.DEVNULL,
        )


def run_chaos(workdir: Path, steps: int, kills: list[tuple[str, int]], timeout_s: float = 900) -> dict:
    prepare(workdir)
    run_dir = workdir / f"run-{time.strftime('%H%M%S')}"
    job = workdir / "job.yaml"
    job.write_text("{}\n")
    log = (workdir / f"{run_dir.name}.out").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetrl.app.cli",
            "run",
            "--config",
            str(job),
            "--run-dir",
            str(run_dir),
            "--no-status",
            *job_overrides(workdir, steps),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    t0 = time.monotonic()
    try:
        kills_done = control(run_dir, proc, kills, t0 + timeout_s)
        code = proc.wait(timeout=max(1, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        log.close()
    report = {
        "exit_code": code,
        "steps": steps,
        "kills": kills_done,
        "wall_s": time.monotonic() - t0,
        **check(run_dir, workdir / "spool", steps),
        "run_dir": str(run_dir),
    }
    report["kills_survived"] = sum(1 for k in kills_done if k["recover_s"] is not None)
    return report


def parse_kills(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, text.split(",")):
        name, _, step = item.partition("@")
        out.append((name, int(step)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", default="rollout-0@8,broker@16,learner@24")
    ap.add_argument("--workdir")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run_chaos(Path(args.workdir or tmp), args.steps, parse_kills(args.kills))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for key in (
        "exit_code",
        "kills_survived",
        "acknowledged",
        "trained",
        "still_queued",
        "lost",
        "duplicated",
        "versions_monotonic",
        "reached_final_step",
    ):
        print(f"{key:22s} {report[key]}")
    for k in report["kills"]:
        print(f"  kill {k['killed']:10s} after step {k['after_step']:3d}: recovered in {k['recover_s']} s")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
