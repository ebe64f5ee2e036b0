"""Chaos in pinned states: kill each role at a chosen point of its work, then prove from the run's logs and
spool that it was survived — or that it failed fast, naming the cause.

    python benchmarks/chaos_pinned.py [--scenarios all|rollout-idle,learner-step,...] [--random 5] [--join]

Each scenario is a `fleetrl run` (tiny model, 2 rollout servers, gloo weight sync, spool and commits on,
checkpoints every 4 steps, `run.restart_policy: on-failure`). The targeted process is stopped at its
point with ``FLEETRL_PIN`` (``common/faults/pins.py``) and SIGKILLed there:

| scenario | pinned at | survival means |
| --- | --- | --- |
| rollout-idle / rollout-generate | before a lease / inside generation | its prompts come back, it restarts and is admitted only once it holds the current weights |
| rollout-broadcast | between two buckets of a round | the learner is delayed <= 2 x sync.bucket_timeout_s in that round (<= the join window + one bucket timeout in the next), the other rollout gets the version |
| broker-spool-write | half of a record written | restart from the spool: the torn record is cut, nothing acknowledged lost |
| broker-disk-full | (no kill) writes fail for 6 s | pushes answered `unavailable`, serving resumes by itself |
| learner-step | trained, not acknowledged | resume from the checkpoint, rewind: nothing lost, nothing trained twice |
| learner-publish | between two buckets of a publish | rollouts drop the round, the resumed learner republishes |

Every scenario checks: exit 0, the final step reached, 0 acknowledged groups lost, 0 trained twice,
policy versions never backwards, and the recovery time (kill -> the next learner step) under a stated
bound. ``--random N`` kills each role N times at random moments in one run; ``--join`` starts a brand-new
rollout server mid-run and checks it catches up with the current version. Figures go to stdout and
``benchmarks/results/chaos_pinned.json``, with the machine's load during each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos import check, last_step, pid_of, prepare, read_jsonl  # noqa: E402

from fleetrl.common.weightsync import JOIN_WINDOW_S  # noqa: E402  # a round waits this long for a registered receiver

BUCKET_S = 3.0  # sync.bucket_timeout_s of these runs
ARM_AT = 5  # the learner step after which the pinned point is armed


@dataclass
class Scenario:
    name: str
    role: str  # the child the launcher names: rollout-0, broker, learner
    pin: str  # FLEETRL_PIN point ("" = no kill: broker-disk-full)
    after: int  # FLEETRL_PIN_AFTER
    recover_s: float  # the stated bound: kill -> next learner step


SCENARIOS = {
    s.name: s
    for s in [
        Scenario("rollout-idle", "rollout", "rollout.idle", 2, 60.0),
        Scenario("rollout-generate", "rollout", "rollout.generate", 1, 60.0),
        Scenario("rollout-broadcast", "rollout", "rollout.broadcast", 2, 2 * BUCKET_S + 30.0),
        Scenario("broker-spool-write", "broker", "broker.spool_write", 20, 90.0),
        Scenario("broker-disk-full", "broker", "", 0, 60.0),
        Scenario("learner-step", "learner", "learner.step", 1, 180.0),
        Scenario("learner-publish", "learner", "learner.publish", 1, 180.0),
    ]
}


def overrides(workdir: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"model.path={workdir / 'tiny'}",
        f"data.train={workdir / 'data.jsonl'}",
        "rollout.group_size=4",
        "rollout.num_servers=2",
        "rollout.prompts_per_batch=2",
        "rollout.max_new_tokens=4",
        "rollout.rewards=[{name: exact}]",
        "rollout.device=cpu",
        "learner.device=cpu",
        "learner.groups_per_step=4",
        f"learner.total_steps={steps}",
        "learner.lr=1e-3",
        "learner.batch_wait_s=300",
        "sync.transport=gloo",
        f"sync.bucket_timeout_s={BUCKET_S}",
        "sync.bucket_mb=0.05",
        "sync.timeout_s=60",
        "checkpoint.interval=4",
        "checkpoint.keep_last=3",
        f"broker.spool_dir={run_dir.parent / (run_dir.name + '-spool')}",
        "broker.commit_on_checkpoint=true",
        "broker.max_staleness=1000",
        "broker.queue_capacity=40",
        "broker.fsync=never",
        "broker.prompt_lease_s=20",
        "broker.client_timeout_s=6",
        "broker.batch_lease_s=60",
        "broker.request_timeout_s=5",
        "run.restart_policy=on-failure",
        "run.max_restarts=8",
        "run.ready_timeout_s=300",
        "health.enabled=false",
    ]


def start(workdir: Path, name: str, steps: int, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    run_dir = workdir / f"{name}-{time.strftime('%H%M%S')}"
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
            *overrides(workdir, run_dir, steps),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env},
    )
    return proc, run_dir


def wait_for(cond, deadline: float, proc: subprocess.Popen) -> bool:
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def recovery(run_dir: Path, killed_at: float, deadline: float, proc: subprocess.Popen) -> float | None:
    """Seconds from the kill to the next learner step (None: it never came)."""
    while time.monotonic() < deadline:
        later = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("time", 0) > killed_at]
        if later:
            return later[0]["time"] - killed_at
        if proc.poll() is not None:
            return None
        time.sleep(0.2)
    return None


def finish(proc: subprocess.Popen, run_dir: Path, steps: int, deadline: float) -> dict:
    try:
        code = proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    return {
        "exit_code": code,
        **check(run_dir, run_dir.parent / (run_dir.name + "-spool"), steps),
        "run_dir": str(run_dir),
    }


def run_pinned(workdir: Path, sc: Scenario, steps: int = 20, timeout_s: float = 900) -> dict:
    pins = workdir / f"pins-{sc.name}-{time.strftime('%H%M%S')}"
    pins.mkdir()
    env = {"FLEETRL_PIN": sc.pin, "FLEETRL_PIN_DIR": str(pins), "FLEETRL_PIN_AFTER": str(sc.after)} if sc.pin else {}
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    proc, run_dir = start(workdir, sc.name, steps, env)
    deadline = t0 + timeout_s
    out = {"scenario": sc.name, "killed": None, "recover_s": None}
    if sc.pin:
        marker = pins / f"{sc.pin}.pinned"
        if wait_for(lambda: last_step(run_dir)[0] >= ARM_AT, deadline, proc):
            (pins / f"{sc.pin}.armed").write_text("")  # from now on the point pins (mid-run, not at start-up)
        if wait_for(marker.exists, deadline, proc):
            time.sleep(0.2)
            pid = int(marker.read_text())
            killed_at = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died by itself while pinned: reported as not killed
                pid = None
            (pins / f"{sc.pin}.done").write_text("")
            out.update(killed=pid, killed_at_step=last_step(run_dir)[0])
            out["recover_s"] = recovery(run_dir, killed_at, deadline, proc)
    else:  # disk full: the broker's spool may not grow for 6 s
        if wait_for(lambda: last_step(run_dir)[0] >= ARM_AT, deadline, proc):
            pid = pid_of(run_dir, "broker")
            spool = run_dir.parent / (run_dir.name + "-spool")
            size = max(p.stat().st_size for p in spool.glob("segment-*.log"))
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))
            full_at = time.time()
            time.sleep(6.0)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            out["recover_s"] = recovery(run_dir, full_at + 6.0, deadline, proc)
            time.sleep(1.0)
            events = [r["event"] for r in read_jsonl(run_dir / "audit.jsonl")]
            log = run_dir / "logs" / "broker.log"
            out.update(
                full_for_s=6.0,
                spool_unavailable="spool_unavailable" in events,
                spool_writable_again="spool_writable" in events,
                alerted=log.exists() and "ALERT" in log.read_text(),
            )
    out.update(finish(proc, run_dir, steps, deadline))
    out["wall_s"], out["load_before"], out["load_after"] = time.monotonic() - t0, load0, os.getloadavg()[0]
    out["survived"] = survived(out, sc)
    if sc.name == "rollout-broadcast":
        out.update(broadcast_checks(run_dir, out.get("killed_at_step")))
    if sc.role == "rollout" and sc.pin:
        out["readmitted_with_current_weights"] = readmitted(run_dir)
    return out


def survived(r: dict, sc: Scenario) -> bool:
    return (
        r["exit_code"] == 0
        and r["reached_final_step"]
        and r["lost"] == 0
        and r["duplicated"] == 0
        and r["versions_monotonic"]
        and r["recover_s"] is not None
        and r["recover_s"] <= sc.recover_s
    )


def broadcast_checks(run_dir: Path, killed_at_step: int | None) -> dict:
    """The round the rollout died in, the learner delayed within the stated bound, the other rollout got it.

    The dead receiver leaves the fleet one of two ways, depending on where the learner's (overlapped) round
    was when the pin was hit: the round re-forms without it (``sync/reforms``; bound: 2 x bucket timeout), or
    the round's sends had already been buffered and it is the *next* round that forms without it, after
    waiting its join window for the dead (or restarted, still loading) receiver (bound: join window + one
    bucket timeout). Rounds before the kill (a rollout still starting) are not judged."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    fleet = max((r.get("sync/receivers", 0) for r in rows), default=0)
    after = [r for r in rows if killed_at_step is None or r.get("step", 0) >= killed_at_step]
    reformed = [r for r in after if r.get("sync/reforms", 0) >= 1]
    short = [r for r in after if r.get("sync/reforms", 0) == 0 and 0 < r.get("sync/receivers", fleet) < fleet]
    affected = sorted(reformed + short, key=lambda r: r.get("step", 0))
    killed = {e["child"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "restart"}
    survivor = f"rollout-{1 if 'rollout-0' in killed else 0}"
    other = read_jsonl(run_dir / f"{survivor}.metrics.jsonl")
    versions = [int(r.get("policy/version", 0)) for r in affected]
    # what the survivor loaded: its metrics rows, and its log's "policy version A -> B" lines (a round right
    # before the end lands after the survivor's last metrics row, and short rounds no longer wait out the join
    # window for the restarting receiver, so the last affected round is often the run's last)
    log = run_dir / "logs" / f"{survivor}.log"
    loaded = [int(v) for v in re.findall(r"policy version \d+ -> (\d+)", log.read_text())] if log.exists() else []
    got = max([int(r.get("rollout/policy_version", -1)) for r in other] + loaded, default=-1)
    sync_s = lambda r: r.get("timing/sync_s", 0.0)  # noqa: E731
    return {
        "reformed_rounds": len(reformed),
        "affected_rounds": len(affected),
        "sync_s_of_affected": [(int(r.get("step", 0)), round(sync_s(r), 2)) for r in affected],
        "learner_delay_ok": bool(affected)
        and all(sync_s(r) <= 2 * BUCKET_S + 1.0 for r in reformed)
        and all(sync_s(r) <= JOIN_WINDOW_S + BUCKET_S + 1.0 for r in short),
        "survivor_got_reformed_versions": bool(versions) and all(got >= v for v in versions),
        "survivor_missed_rounds": other[-1].get("weights/rounds_missed") if other else None,
        "survivor_final_version": got,
        "learner_final_version": rows[-1].get("policy/version") if rows else None,
    }


def readmitted(run_dir: Path) -> bool | None:
    """After its restart, the killed rollout's first batch used at least the version the learner held then."""
    restarts = [
        e
        for e in read_jsonl(run_dir / "events.jsonl")
        if e.get("event") == "restart" and str(e.get("child", "")).startswith("rollout")
    ]
    if not restarts:
        return None
    t, role = restarts[0]["time"], restarts[0]["child"]
    before = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["time"] <= t]
    current = before[-1]["policy/version"] if before else 0
    after = [r for r in read_jsonl(run_dir / f"{role}.metrics.jsonl") if r["time"] > t]
    return bool(after) and after[0]["rollout/policy_version"] >= current


def run_random(workdir: Path, per_role: int, steps: int = 120, timeout_s: float = 2400) -> dict:
    """``per_role`` kills of each role (both rollouts, the broker, the learner) at random moments of one run;
    each kill waits until the role's current process is up (not the one killed before)."""
    import psutil

    rng = random.Random(0)
    proc, run_dir = start(workdir, "random", steps, {})
    deadline = time.monotonic() + timeout_s
    roles = ["rollout-0", "rollout-1", "broker", "learner"] * per_role
    rng.shuffle(roles)
    plan = sorted(rng.uniform(4, steps - 10) for _ in roles)
    kills, killed = [], set()
    for at, role in zip(plan, roles):
        up = lambda: (p := pid_of(run_dir, role)) is not None and p not in killed and psutil.pid_exists(p)  # noqa: E731
        if not (wait_for(lambda: last_step(run_dir)[0] >= at, deadline, proc) and wait_for(up, deadline, proc)):
            break
        time.sleep(rng.uniform(0, 1.5))
        pid = pid_of(run_dir, role)
        killed_at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.add(pid)
        kills.append(
            {
                "role": role,
                "after_step": last_step(run_dir)[0],
                "recover_s": recovery(run_dir, killed_at, deadline, proc),
            }
        )
    out = {"scenario": "random", "kills": kills, **finish(proc, run_dir, steps, deadline)}
    out["kills_per_role"] = {r: sum(k["role"] == r for k in kills) for r in sorted(set(roles))}
    out["survived"] = (
        out["exit_code"] == 0
        and out["lost"] == 0
        and out["duplicated"] == 0
        and out["reached_final_step"]
        and out["versions_monotonic"]
    )
    return out


def run_join(workdir: Path, steps: int = 600, timeout_s: float = 900) -> dict:
    """A brand-new rollout server joins mid-run: from its ready signal, how long until it generates with
    the version the learner held then (or newer)."""
    proc, run_dir = start(workdir, "join", steps, {})
    deadline = time.monotonic() + timeout_s
    out: dict = {"scenario": "join", "caught_up_s": None}
    if wait_for(lambda: last_step(run_dir)[0] >= 8, deadline, proc):
        new = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetrl.app.cli",
                "rollout",
                "--config",
                str(workdir / "job.yaml"),
                "--run-dir",
                str(run_dir),
                "--server-index",
                "7",
                *overrides(workdir, run_dir, steps),
            ],
            stdout=(run_dir / "rollout-7.out").open("w"),
            stderr=subprocess.STDOUT,
        )
        ready = run_dir / "rollout-7.ready"
        if wait_for(ready.exists, deadline, proc):
            ready_at = time.time()
            target = _learner_version_at(run_dir, ready_at)
            caught = wait_for(
                lambda: any(
                    r.get("rollout/policy_version", 0) >= target
                    for r in read_jsonl(run_dir / "rollout-7.metrics.jsonl")
                ),
                deadline,
                proc,
            )
            rows = read_jsonl(run_dir / "rollout-7.metrics.jsonl")
            out.update(
                caught_up_s=time.time() - ready_at if caught else None,
                learner_version_at_ready=target,
                registered_with_version=json.loads(ready.read_text()).get("policy_version"),
                first_batch_version=rows[0]["rollout/policy_version"] if rows else None,
                catchups=rows[-1].get("weights/catchups") if rows else None,
            )
        new.send_signal(signal.SIGTERM)
        new.wait(timeout=60)
    os.killpg(proc.pid, signal.SIGINT)  # enough: the run need not reach its last step
    out.update(finish(proc, run_dir, steps, deadline))
    out["survived"] = out["caught_up_s"] is not None and out["lost"] == 0 and out["duplicated"] == 0
    return out


def _learner_version_at(run_dir: Path, t: float) -> int:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["time"] <= t]
    return int(rows[-1]["policy/version"]) if rows else 0


def _learner_version(run_dir: Path) -> int:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return int(rows[-1]["policy/version"]) if rows else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="all", help="comma list of " + ", ".join(SCENARIOS) + ", or all / none")
    ap.add_argument("--random", type=int, default=0, metavar="N", help="N random-moment kills of each role")
    ap.add_argument("--join", action="store_true", help="a new rollout server joins mid-run")
    ap.add_argument("--workdir")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos_pinned.json"))
    args = ap.parse_args()
    names = list(SCENARIOS) if args.scenarios == "all" else [n for n in args.scenarios.split(",") if n and n != "none"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        prepare(workdir)
        for name in names:
            results.append(run_pinned(workdir, SCENARIOS[name]))
            print(json.dumps(results[-1]), flush=True)
        if args.random:
            results.append(run_random(workdir, args.random))
            print(json.dumps(results[-1]), flush=True)
        if args.join:
            results.append(run_join(workdir))
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    for r in results:
        print(
            f"{r['scenario']:20s} survived={r['survived']} lost={r.get('lost')} duplicated={r.get('duplicated')} "
            f"recover_s={r.get('recover_s')} exit={r.get('exit_code')}"
        )
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
