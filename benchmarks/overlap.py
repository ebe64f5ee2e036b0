"""Does the asynchrony overlap? The demo job for ``--minutes`` of RL, and how busy it kept the machine.

Runs ``fleetrl run --config configs/demo.yaml`` (the demo's warm start, built as `make demo` builds it)
and samples the CPU time of the job's whole process tree once a second. Reports, over the RL phase only
(from the learner's first step to its last):

- ``cores_busy``: CPU seconds of all the job's processes / wall seconds (2.0 = both cores of a 2-core box);
- per process: learner, rollout servers, broker (CPU seconds / wall seconds each);
- ``wait_frac``: the learner's ``timing/wait_batch_s`` / ``timing/step_total_s``, summed over steps;
- ``cpu_s_per_1k``: CPU seconds per 1,000 trained samples, per role and for the whole job (the figure of
  merit on a shared box: wall-clock rates move with others' load, CPU per unit of work much less);
- trained samples/s, the rollout's throttled seconds, the held-out accuracy curve (start, best, end);
- ``stale_frac``: the share of the groups the learner's leases met that were dropped as stale (generated
  work wasted: the admission window's tail);
- others' CPU share: the machine's busy CPU spent neither by the job nor by this driver (a figure above
  10% is flagged).

    python benchmarks/overlap.py [--minutes 3] [--label after] [--set KEY=VALUE ...]
    python benchmarks/overlap.py --pythonpath DIR --label before    # another tree's code (see docs/benchmarks.md)
    python benchmarks/overlap.py --profile 60 --label prof          # + py-spy profiles of each process (60 s of RL)

``--pythonpath DIR`` puts DIR first on the children's PYTHONPATH, so a directory holding ``fleetrl/`` with
``common``, ``broker``, ``rollout`` and ``learner`` linked to an older checkout runs that checkout's code with
this venv: the before/after comparison of one session on one box. Saves benchmarks/results/overlap-<label>.json.
``--profile S`` (needs `py-spy` on PATH or in the venv) records each of the job's processes for S seconds once RL
has begun, as collapsed stacks ``<run-dir>/profile-<role>.txt``, and prints each one's heaviest functions
(`summarize_profile`); the sampler's own CPU is not the job's but does load the box, so take speed figures
from runs without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import BUSY_SHARE, ROOT, CpuWatch, prepare, stop  # noqa: E402

from fleetrl.common.telemetry.cpu import machine_busy_s  # noqa: E402


def role_of(proc: psutil.Process) -> str:
    """learner / rollout-N / broker / other, from the command line `fleetrl run` starts each child with."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return "other"
    if "rollout" in argv:
        return "rollout-" + (argv[argv.index("--server-index") + 1] if "--server-index" in argv else "0")
    if "broker" in argv:
        return "broker"
    if "learner" in argv or "fleetrl.app.learner" in argv:  # `fleetrl learner`, or a rank under torchrun
        return "learner"
    if "run" in argv:
        return "launcher"
    return "other"


def tree_cpu(root: psutil.Process, seen: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role of ``root``'s live descendants; ``seen`` keeps each process's last reading, so one
    that exits between samples keeps its last value (the RL phase ends before any exits)."""
    try:
        procs = [root, *root.children(recursive=True)]  # the launcher too: it is part of the job
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            t = p.cpu_times()
            seen[p.pid] = (seen.get(p.pid, (role_of(p), 0.0))[0], t.user + t.system)
        except psutil.Error:
            pass
    out: dict[str, float] = {}
    for role, cpu in seen.values():
        out[role] = out.get(role, 0.0) + cpu
    return out


def stale_share(rows: list[dict]) -> float:
    """Groups the learner's leases dropped as stale / all it was handed or dropped (trained, filtered, stale)."""
    stale = sum(r.get("batch/dropped_stale", 0.0) for r in rows)
    taken = sum(r.get("batch/groups", 0.0) + r.get("batch/filtered_groups", 0.0) for r in rows)
    return stale / (stale + taken) if stale + taken else 0.0


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return rows


class StepCounter:
    """Learner steps in metrics.jsonl, read incrementally (the driver must not cost the job CPU)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.steps, self.partial = path, 0, 0, b""

    def poll(self) -> int:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.steps
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        self.steps += sum(1 for line in lines if b'"timing/step_total_s"' in line)
        return self.steps


def py_spy() -> str | None:
    """The py-spy executable: the venv's (next to this interpreter) or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def start_profiles(root: psutil.Process, run_dir: Path, seconds: float) -> list[subprocess.Popen]:
    """One `py-spy record` per process of the job (not the launcher), collapsed stacks per thread, idle
    samples left out: where each process spends its CPU."""
    exe = py_spy()
    if exe is None:
        print("--profile: py-spy not found (pip install py-spy); no profile taken")
        return []
    procs = []
    for p in root.children(recursive=True):
        role = role_of(p)
        if role in ("launcher", "other"):
            continue
        out = run_dir / f"profile-{role}.txt"
        procs.append(
            subprocess.Popen(
                [
                    exe,
                    "record",
                    "--pid",
                    str(p.pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--threads",
                    "--nonblocking",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def thread_cpu(root: psutil.Process) -> dict[str, dict[int, float]]:
    """CPU seconds of every live thread (native id) of each of the job's processes, by role."""
    out: dict[str, dict[int, float]] = {}
    for p in root.children(recursive=True):
        try:
            out[role_of(p)] = {t.id: t.user_time + t.system_time for t in p.threads()}
            out[role_of(p)][0] = sum(p.cpu_times()[:2])  # 0: the whole process (threads that ended included)
        except psutil.Error:
            pass
    return out


def thread_names(path: Path) -> dict[int, str]:
    """Native thread id -> Python thread name, from a py-spy profile's ``thread (TID): NAME`` frames."""
    names = {}
    for line in path.read_text().splitlines():
        head = line.split(";", 1)[0]
        if head.startswith("thread (") and "): " in head:
            tid, _, name = head[len("thread (") :].partition("): ")
            if tid.isdigit():
                names[int(tid)] = name
    return names


def thread_report(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], seconds: float, run_dir: Path
) -> str:
    """Cores each thread kept busy over the profile window (exact CPU time, not samples), by role."""
    lines = [f"CPU per thread over the {seconds:.0f} s profile window (cores):"]
    for role in sorted(after):
        names = thread_names(run_dir / f"profile-{role}.txt") if (run_dir / f"profile-{role}.txt").exists() else {}
        b, a = before.get(role, {}), after[role]
        whole = (a.get(0, 0.0) - b.get(0, 0.0)) / seconds
        per: collections.Counter[str] = collections.Counter()
        for tid, cpu in a.items():
            if tid:
                per[names.get(tid, "(unnamed)")] += (cpu - b.get(tid, 0.0)) / seconds
        shown = sum(per.values())
        parts = ", ".join(f"{name} {v:.3f}" for name, v in per.most_common() if v >= 0.0005)
        lines.append(f"  {role} {whole:.3f}: {parts}; threads that ended {max(0.0, whole - shown):.3f}")
    return "\n".join(lines)


def summarize_profile(path: Path, top: int = 25) -> str:
    """The heaviest functions of one collapsed-stack profile: inclusive share (on the stack) and self share."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        for f in set(frames[1:]):
            incl[f] += n
        if len(frames) > 1:
            own[frames[-1]] += n
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.name}: {total} samples"]
    lines += [f"  thread {100 * n / total:5.1f}%  {t}" for t, n in threads.most_common(8)]
    lines += [
        f"  incl {100 * n / total:5.1f}%  self {100 * own[f] / total:5.1f}%  {f}" for f, n in incl.most_common(top)
    ]
    lines += ["  -- self:"] + [f"  self {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--label", default="after")
    ap.add_argument(
        "--pythonpath", help="run another tree's fleetrl (a dir holding fleetrl/{common,broker,rollout,learner})"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    ap.add_argument("--workdir", default=str(ROOT), help="where models/demo-warm and data/ are (default: the checkout)")
    ap.add_argument("--eval-interval", type=int, default=40)
    ap.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="S",
        help="record each process with py-spy for S seconds once RL has begun (see the docstring)",
    )
    args = ap.parse_args()
    work = prepare(Path(args.workdir), 0.25)
    run_dir = ROOT / "runs" / f"overlap-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [
        f"model.path={work['warm']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.max_minutes={args.minutes}",
        f"run.eval_interval={args.eval_interval}",
        "checkpoint.interval=0",
        *args.set,
    ]
    # a tree from before the re-floor (issue 25) has its CLI in common/
    old_tree = args.pythonpath and not (Path(args.pythonpath) / "fleetrl" / "app" / "cli.py").exists()
    argv = [
        sys.executable,
        "-m",
        "fleetrl.common.cli" if old_tree else "fleetrl.app.cli",
        "run",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--run-dir",
        str(run_dir),
        "--no-status",
        *overrides,
    ]
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([args.pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    seen: dict[int, tuple[str, float]] = {}
    samples: list[tuple] = []  # (time, learner steps, cpu per role, machine busy less this driver, steal)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        root = psutil.Process(proc.pid)
        watch = CpuWatch()
        deadline = time.monotonic() + 60 * args.minutes + 600
        counter = StepCounter(run_dir / "metrics.jsonl")
        profiles: list[subprocess.Popen] | None = None if args.profile > 0 else []
        threads: list[tuple[float, dict]] = []  # (time, thread_cpu) at the profile window's start and end
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                steps = counter.poll()
                if profiles is None and steps >= 20:  # RL runs (past the first steps' warm-up)
                    threads.append((time.monotonic(), thread_cpu(root)))
                    profiles = start_profiles(root, run_dir, args.profile)
                if len(threads) == 1 and time.monotonic() - threads[0][0] >= args.profile:
                    threads.append((time.monotonic(), thread_cpu(root)))
                samples.append(
                    (
                        time.monotonic(),
                        steps,
                        tree_cpu(root, seen),
                        machine_busy_s() - time.process_time(),
                        psutil.cpu_times().steal,
                    )
                )
                time.sleep(1.0)
        finally:
            code = proc.wait(timeout=5) if proc.poll() is not None else stop(proc)
            for prof in profiles or []:
                prof.wait(timeout=30)
    whole = watch.result()
    rl = [s for s in samples if s[1] > 0]
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("step", 0) > 0 and "timing/step_total_s" in r]
    if len(rl) < 2 or not rows:
        print(f"the run made no progress (exit {code}); see {log}")
        return 1
    last = next(i for i, s in enumerate(rl) if s[1] == rl[-1][1])  # the first sample at the final step count
    first, end = rl[0], rl[max(1, last)]
    wall = end[0] - first[0]
    per_role = {k: (end[2].get(k, 0.0) - first[2].get(k, 0.0)) / wall for k in end[2]}
    busy = (end[3] - first[3]) / wall
    steal = (end[4] - first[4]) / wall  # CPU the hypervisor gave other guests: inside `busy`, not the job's
    cores = os.cpu_count() or 1
    totals = {r["step"]: r.get("batch/samples_total", 0.0) for r in rows}
    window_samples = totals.get(end[1], 0.0) - totals.get(first[1], 0.0)  # trained between the two CPU readings
    cpu_per_1k = {k: 1000 * v * wall / window_samples for k, v in per_role.items()} if window_samples else {}
    evals = [(r["step"], r["eval/accuracy"]) for r in read_rows(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    rollout_rows = read_rows(run_dir / "rollout-0.metrics.jsonl")
    wait = sum(r.get("timing/wait_batch_s", 0.0) for r in rows)
    total = sum(r["timing/step_total_s"] for r in rows)
    rl_wall = rows[-1]["time"] - (rows[0]["time"] - rows[0]["timing/step_total_s"])
    result = {
        "label": args.label,
        "pythonpath": args.pythonpath,
        "overrides": overrides,
        "exit_code": code,
        "run_dir": str(run_dir),
        "cores": cores,
        "rl_wall_s": rl_wall,
        "steps": rows[-1]["step"],
        "cores_busy": sum(per_role.values()),
        "cpu_per_role": per_role,
        "cpu_s_per_1k": {**cpu_per_1k, "job": sum(cpu_per_1k.values())} if cpu_per_1k else None,
        "wait_frac": wait / total if total else None,
        "trained_samples_per_s": rows[-1].get("batch/samples_total", 0.0) / rl_wall,
        "rollout_throttled_s": sum(r.get("rollout/throttled_s", 0.0) for r in rollout_rows),
        "filtered_groups_per_step": sum(r.get("batch/filtered_groups", 0.0) for r in rows) / len(rows),
        "stale_frac": stale_share(rows),
        "broker_capacity_last": rows[-1].get("broker/capacity"),
        "eval": {
            "start": evals[0][1] if evals else None,
            "best": max((a for _, a in evals), default=None),
            "end": evals[-1][1] if evals else None,
            "curve": evals,
        },
        "others_cpu_share": max(0.0, busy - sum(per_role.values())) / cores,
        "steal_share": steal / cores,
        "others_cpu_share_whole_run": whole["others_cpu_share"],
    }
    result["comparable"] = result["others_cpu_share"] <= BUSY_SHARE
    path = ROOT / "benchmarks" / "results" / f"overlap-{args.label}.json"
    path.write_text(json.dumps(result, indent=1))
    roles = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_role.items()))
    print(
        f"{args.label}: {result['cores_busy']:.2f} of {cores} cores busy during RL ({roles}); learner waits "
        f"{100 * (result['wait_frac'] or 0):.0f}% of each step; {result['trained_samples_per_s']:.0f} trained samples/s; "
        f"{result['steps']} steps; rollout throttled {result['rollout_throttled_s']:.0f} s; "
        f"{100 * result['stale_frac']:.0f}% of the groups leased dropped stale; held-out "
        f"{100 * (result['eval']['start'] or 0):.1f}% -> {100 * (result['eval']['end'] or 0):.1f}%; others' CPU share "
        f"{100 * result['others_cpu_share']:.1f}% (hypervisor steal {100 * result['steal_share']:.1f}% of it)"
        f"{'' if result['comparable'] else ' (BUSY: not comparable)'}"
    )
    if cpu_per_1k:
        print(
            "CPU seconds per 1,000 trained samples: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu_per_1k.items()))
            + f"; job {sum(cpu_per_1k.values()):.2f}"
        )
    for prof in sorted(run_dir.glob("profile-*.txt")):
        print(summarize_profile(prof))
    if len(threads) == 2:
        print(thread_report(threads[0][1], threads[1][1], threads[1][0] - threads[0][0], run_dir))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
