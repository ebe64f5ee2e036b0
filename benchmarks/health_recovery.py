"""Recovery, measured: six faults x three seeds in the real demo, each against an unfaulted run of its seed.

Every run is ``fleetrl run --config configs/demo.yaml`` (broker, one HF rollout server, one learner,
gloo sync, CPU) from the demo's warm start (~25% held-out), ``--steps`` steps, held-out greedy accuracy
on ``--eval-n`` problems every 10 steps, a checkpoint every 10 steps, and the health rules given by
``--rules`` (default: the shipped defaults of this checkout). A fault run sets ``FLEETRL_FAULT*``
(``common/faults/plan.py``) from step / policy version ``--inject-at``:

| fault | FLEETRL_FAULT | for | what goes wrong |
| --- | --- | --- | --- |
| divergence | lr_spike | (learner state) | learning rate x50 until a checkpoint is restored |
| non_finite | nan_grad,nan_reward | 15 versions | one NaN update; 25% of reward scores NaN |
| entropy_collapse | entropy_collapse | 15 versions or 60 s | the fleet samples at temperature 0.1 (ends after 60 s as well: the broker refuses its groups, so no version passes) |
| stale_fleet | stale_fleet | 15 versions | new weights announced, old weights kept (silent sync failure) |
| reward_hack | reward_hack | 40 versions | the reward pays 1 for an empty or one-character answer (15 versions were too few for the policy to find it: reward and length never moved) |
| persistent | reward_hack | 400 versions | the same reward bug, never fixed: it outlives every rollback |
| poison_server | poison_server | 400 versions | with 2 rollout servers, server 1 pays -1e6 and reports log-probs of 0.0 (not one of the six: the quarantine's check) |

Per run: the detection delay (first health event at or after the injection), the rule, the action, the last
rollback step R; then, against the unfaulted run of the same seed, the worst held-out dip after the injection
(accuracy lost) and the held-out accuracy averaged over the evaluations from R + 50 to R + 70 (recovered:
within 3 points of the unfaulted run's average over the same steps; one evaluation of 500 problems swings +-5
points between neighbours on a healthy run). A run the monitor stopped is compared at its last evaluation; a
run that died (e.g. ``FleetIdle``: every group refused for ``learner.batch_wait_s``) is never recovered and
counts as the worst gap in the median of its seeds. A reward-hack run (reward_hack, persistent) also gets the
**onset** of the hack, read from what the policy does (``health_analysis.hack_onset``: the first evaluation at
which the share of held-out greedy answers the bug pays, from their mean length, exceeds its pre-fault level
by more than 0.05; the onset is the step after the last evaluation that did not) and the detection delay from
the bug and from that onset. Resumable: a finished run is not run again (``--again`` to force); results are
merged into benchmarks/results/health_recovery.json.

    nice -n 10 python benchmarks/health_recovery.py [--faults divergence,reward_hack] [--seeds 1,2,3]
    python benchmarks/health_recovery.py --analyze-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, prepare, run_child, tail  # noqa: E402
from health_analysis import ONSET_MARGIN, detection, eval_curve, eval_lengths, hack_onset  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "health_recovery.json"
FAULTS = {  # name: (FLEETRL_FAULT, FLEETRL_FAULT_FOR)
    "divergence": ("lr_spike", 15),
    "non_finite": ("nan_grad,nan_reward", 15),
    "entropy_collapse": ("entropy_collapse", 15),
    "stale_fleet": ("stale_fleet", 15),
    "reward_hack": ("reward_hack", 40),
    "persistent": ("reward_hack", 400),
    "poison_server": ("poison_server", 400),
}
EXTRA = {  # overrides, environment
    "poison_server": (["rollout.num_servers=2"], {"FLEETRL_FAULT_SERVER": "1"}),
    # at T 0.1 the broker refuses every group as implausible (log-probs of exactly 0.0): the learner waits, no
    # version passes, and a fault counted in versions alone never ended (the run idled into FleetIdle); a real
    # fleet's sampling settings get put right after a while, so this one also ends 60 s after it began
    "entropy_collapse": ([], {"FLEETRL_FAULT_FOR_S": "60"}),
}
BASELINE = {"poison_server": "unfaulted2"}  # compared with an unfaulted run of the same shape (2 rollout servers)
AFTER = 50  # judge the recovery this many steps after the last rollback
SPAN = 20  # over the evaluations from AFTER to AFTER + SPAN steps after it
POINTS = 0.03


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def learner_stopped(run_dir: Path) -> bool:
    """The learner exited 3 (the health monitor stopped the run), as `fleetrl run`'s log reports it."""
    log = run_dir / "run.log"
    return log.exists() and re.search(r"learner\s+exit 3\b", log.read_text(errors="replace")) is not None


def run_one(name: str, work: dict, args, seed: int, fault: str | None, extra: list[str] | None = None) -> dict:
    run_dir = Path(args.workdir) / "runs" / name
    done = run_dir / "done.json"
    if done.exists() and not args.again:
        return json.loads(done.read_text())
    sets = [
        f"model.path={work['warm']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.total_steps={args.steps}",
        "learner.max_minutes=0",
        f"run.eval_interval={args.eval_interval}",
        f"run.eval_n={args.eval_n}",
        "checkpoint.interval=10",
        "checkpoint.keep_last=3",
        "telemetry.log_level=WARNING",
        "run.learner_threads=1",
        "run.rollout_threads=1",  # no OMP spinning on a shared box (counts, not speed)
        f"learner.seed={seed}",
        f"rollout.seed={seed}",
        f"data.seed={seed}",
    ]
    if args.rules:
        sets.append(f"health.rules={args.rules}")
    sets += EXTRA.get(fault or "", ([], {}))[0] + (extra or [])
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--run-dir",
        str(run_dir),
        "--no-status",
        *sets,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if fault:
        kind, duration = FAULTS[fault]
        env.update(
            FLEETRL_FAULT=kind,
            FLEETRL_FAULT_AT=str(args.inject_at),
            FLEETRL_FAULT_FOR=str(duration),
            **EXTRA.get(fault, ([], {}))[1],
        )
    if run_dir.exists():  # an unfinished run: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    print(
        f"[{name}] seed {seed}" + (f", {fault} ({FAULTS[fault][0]}) from {args.inject_at}" if fault else ""), flush=True
    )
    code, cpu = run_child(name, argv, run_dir / "run.log", 60 * args.timeout_min, env=env)
    if code != 0 and learner_stopped(run_dir):
        code = 3  # `fleetrl run` exits 1 when its learner stops on the health monitor (exit 3): a stop, not a failure
    rows = read_jsonl(run_dir / "metrics.jsonl")
    result = {
        "name": name,
        "fault": fault,
        "seed": seed,
        "exit_code": code,
        "cpu": cpu,
        "inject_at": args.inject_at,
        "steps": max((int(r["step"]) for r in rows), default=0),
        "curve": eval_curve(rows),
        "eval_len": eval_lengths(rows),
        "events": read_jsonl(run_dir / "events.jsonl"),
        "command": (
            f"FLEETRL_FAULT={FAULTS[fault][0]} FLEETRL_FAULT_AT={args.inject_at} FLEETRL_FAULT_FOR={FAULTS[fault][1]} "
            + "".join(f"{k}={v} " for k, v in EXTRA.get(fault, ([], {}))[1].items())
            if fault
            else ""
        )
        + "fleetrl "
        + " ".join(argv[3:]),
    }
    print(
        f"  exit {code}, {result['steps']} steps, {len(result['events'])} events, others' CPU "
        f"{cpu['others_cpu_share']:.0%}",
        flush=True,
    )
    if code in (0, 3) and result["steps"]:
        done.write_text(json.dumps(result, indent=1))
    else:
        print(f"  [{name}] failed; its log ends with:\n{tail(run_dir / 'run.log')}", flush=True)
    return result


def compare(run: dict, base: dict) -> dict:
    """One fault run against the unfaulted run of its seed (see the module docstring)."""
    at = run["inject_at"]
    det = detection(run["events"], at)
    if run["exit_code"] == 3 and det["detected"]:
        det["action"] = "stop"
    rollbacks = [e["step"] for e in run["events"] if e["rule"] == "rollback" and e["step"] >= at]
    recovered_from = max(rollbacks, default=None)
    if recovered_from is None and det["detected"]:
        recovered_from = at + det["delay_steps"]
    base_at = dict(base["curve"])
    dips = [base_at[s] - a for s, a in run["curve"] if s > at and s in base_at]
    start = (recovered_from or at) + AFTER  # the evaluations in [start, start + SPAN], averaged (one swings +-5 points)
    judged = [(s, a) for s, a in run["curve"] if start <= s <= start + SPAN and s in base_at]
    if not judged and run["curve"] and run["curve"][-1][0] in base_at:  # stopped (or too short): its last evaluation
        judged = [run["curve"][-1]]
    out = {
        "detected": det["detected"],
        "delay_steps": det["delay_steps"],
        "first_rule": det["first_rule"],
        "action": det["action"],
        "rollbacks": len(rollbacks),
        "recovered_from_step": recovered_from,
        "accuracy_lost_max": max(dips, default=None),
        "stopped": run["exit_code"] == 3,
        "died": run["exit_code"] not in (0, 3),  # e.g. FleetIdle: every group refused, nothing trained for batch_wait_s
    }
    if judged:
        acc, ref = statistics.mean(a for _, a in judged), statistics.mean(base_at[s] for s, _ in judged)
        out.update(
            judged_at=[s for s, _ in judged],
            accuracy=acc,
            unfaulted=ref,
            gap=ref - acc,
            recovered=acc >= ref - POINTS and not out["died"],  # a run that died recovered nothing
        )
    else:
        out.update(judged_at=None, accuracy=None, unfaulted=None, gap=None, recovered=False)
    if FAULTS.get(run.get("fault") or "", ("",))[0] == "reward_hack":
        out.update(onset(run, det))
    return out


def onset(run: dict, det: dict) -> dict:
    """A reward-hack run: when the policy began to exploit the bug (health_analysis.hack_onset, from the held-out
    answers' lengths) and the detection delay counted from the bug and from that onset."""
    at = run["inject_at"]
    found = hack_onset([tuple(x) for x in run.get("eval_len") or []], at)
    detected_at = at + det["delay_steps"] if det["detected"] else None
    return {
        "bug_step": at,
        "onset_step": found["onset_step"],
        "onset_seen_step": found["seen_step"],
        "onset_share": found["share"],
        "detected_step": detected_at,
        "delay_from_bug": det["delay_steps"],
        "delay_from_onset": None
        if detected_at is None or found["onset_step"] is None
        else detected_at - found["onset_step"],
        "delay_from_seen": None
        if detected_at is None or found["seen_step"] is None
        else detected_at - found["seen_step"],
    }


def summarize(runs: dict[str, dict], faults: list[str], seeds: list[int]) -> dict:
    table = {}
    for fault in faults:
        base = BASELINE.get(fault, "unfaulted")
        per_seed = {
            s: compare(runs[f"{fault}-s{s}"], runs[f"{base}-s{s}"])
            for s in seeds
            if f"{fault}-s{s}" in runs and f"{base}-s{s}" in runs
        }
        if not per_seed:
            continue
        # a run that died counts as the worst gap: the median of 3 is recovered only if 2 seeds are
        gaps = [math.inf if r["died"] else r["gap"] for r in per_seed.values() if r["gap"] is not None or r["died"]]
        median = statistics.median(gaps) if gaps else None
        delays = [r["delay_steps"] for r in per_seed.values() if r["delay_steps"] is not None]
        table[fault] = {
            "seeds": per_seed,
            "detected": sum(r["detected"] for r in per_seed.values()),
            "max_delay": max(delays, default=None),
            "median_gap": None if median == math.inf else median,
            "median_seed_died": median == math.inf,
            "recovered_median": median is not None and median <= POINTS,
        }
    six = {k: f for k, f in table.items() if k != "poison_server"}  # the six; the quarantine apart
    detected_fast = sum(
        1
        for f in six.values()
        if f["detected"] == len(f["seeds"]) and f["max_delay"] is not None and f["max_delay"] <= 20
    )
    hacks = [r for f in table.values() for r in f["seeds"].values() if "delay_from_onset" in r]
    from_onset = [r["delay_from_onset"] for r in hacks]
    return {
        "faults": table,
        "targets": {
            "detected_within_20_steps": f"{detected_fast} of {len(six)} (target 6 of 6)",
            "reward_hack_runs_detected_within_20_steps_of_onset": f"{sum(d is not None and d <= 20 for d in from_onset)}"
            f" of {len(hacks)} (onset found in {sum(r['onset_step'] is not None for r in hacks)})",
            "recovered_within_3_points_median": f"{sum(f['recovered_median'] for f in six.values())} of {len(six)} "
            "(target >= 5 of 6)",
        },
    }


def print_table(summary: dict) -> None:
    print(
        f"\n{'fault':<18}{'seed':>5}{'delay':>7}  {'rule':<22}{'action':<9}{'rb':>3}{'lost':>7}{'at':>5}"
        f"{'acc':>7}{'base':>7}{'gap':>7}"
    )
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    for fault, f in summary["faults"].items():
        for seed, r in f["seeds"].items():
            print(
                f"{fault:<18}{seed:>5}{str(r['delay_steps']):>7}  {str(r['first_rule']):<22}{r['action']:<9}"
                f"{r['rollbacks']:>3}{pct(r['accuracy_lost_max']):>7}{str((r['judged_at'] or ['-'])[0]):>5}"
                f"{pct(r['accuracy']):>7}"
                f"{pct(r['unfaulted']):>7}{pct(r['gap']):>7}" + ("  died (not recovered)" if r.get("died") else "")
            )
        median = "a run that died" if f.get("median_seed_died") else f"{pct(f['median_gap'])} points"
        print(f"{'':<18}median gap {median}; recovered: {f['recovered_median']}")
    hacks = [(fault, seed, r) for fault, f in summary["faults"].items() for seed, r in f["seeds"].items()]
    hacks = [h for h in hacks if "delay_from_onset" in h[2]]
    if hacks:
        print(
            f"\nreward hacking from its onset (held-out paid share > pre-fault + {ONSET_MARGIN}; onset = the step "
            "after the last evaluation under it)\n"
            f"{'fault':<18}{'seed':>5}{'bug':>5}{'onset':>7}{'seen':>6}{'share':>7}{'detected':>10}{'from bug':>10}"
            f"{'from onset':>12}"
        )
        for fault, seed, r in hacks:
            share = "-" if r["onset_share"] is None else f"{r['onset_share']:.2f}"
            print(
                f"{fault:<18}{seed:>5}{r['bug_step']:>5}"
                f"{str(r['onset_step']):>7}{str(r['onset_seen_step']):>6}{share:>7}{str(r['detected_step']):>10}"
                f"{str(r['delay_from_bug']):>10}{str(r['delay_from_onset']):>12}"
            )
    for k, v in summary["targets"].items():
        print(f"  {k}: {v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="runs/health-recovery")
    ap.add_argument(
        "--faults",
        default=",".join(f for f in FAULTS if f != "poison_server"),
        help="comma list of " + ", ".join(FAULTS),
    )
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--inject-at", type=int, default=45)
    ap.add_argument("--eval-n", type=int, default=500)
    ap.add_argument(
        "--eval-interval",
        type=int,
        default=10,
        help="steps between held-out evaluations (5 with --eval-n 250: the same evaluation cost, twice as often)",
    )
    ap.add_argument("--results", default=str(RESULTS), help="the JSON the runs are merged into")
    ap.add_argument("--rules", default="", help="a health.rules override (YAML/JSON list); default: the shipped rules")
    ap.add_argument("--timeout-min", type=float, default=40.0)
    ap.add_argument("--again", action="store_true", help="run finished runs again")
    ap.add_argument("--analyze-only", action="store_true")
    ap.add_argument(
        "--replay",
        action="store_true",
        help="with --analyze-only: the detection this checkout's rules give on the recorded runs (their metrics "
        "replayed through the rules they ran under), written to the results JSON's name + _replay",
    )
    args = ap.parse_args()
    faults, seeds = [f for f in args.faults.split(",") if f], [int(s) for s in args.seeds.split(",") if s]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown {unknown}; valid: {', '.join(FAULTS)}")
    results = Path(args.results)
    previous = json.loads(results.read_text()) if results.exists() else {}
    runs = {r["name"]: r for r in previous.get("runs", [])}
    for done in sorted(Path(args.workdir, "runs").glob("*/done.json")):  # finished runs the JSON may lack
        runs[done.parent.name] = {**json.loads(done.read_text()), "name": done.parent.name}
    for name, run in runs.items():  # recorded before the held-out answer lengths were kept: from the run's files
        metrics = Path(args.workdir, "runs", name, "metrics.jsonl")
        if "eval_len" not in run and metrics.exists():
            run["eval_len"] = eval_lengths(read_jsonl(metrics))
    for name, run in runs.items():  # recorded before stops were told from failures
        if run.get("exit_code") not in (0, 3) and learner_stopped(Path(args.workdir, "runs", name)):
            run["exit_code"] = 3
    if args.analyze_only and not args.rules:  # nothing runs: the recorded runs keep the rules they ran under
        args.rules = previous.get("rules", "")
    if not args.analyze_only:
        work = prepare(Path(args.workdir), 0.25)
        for seed in seeds:  # seed by seed: a stopped sweep has whole comparisons
            runs[f"unfaulted-s{seed}"] = run_one(f"unfaulted-s{seed}", work, args, seed, None)
            for fault in faults:
                if fault in BASELINE:
                    name = f"{BASELINE[fault]}-s{seed}"
                    runs[name] = run_one(name, work, args, seed, None, EXTRA[fault][0])
                runs[f"{fault}-s{seed}"] = run_one(f"{fault}-s{seed}", work, args, seed, fault)
                save(runs, args, faults, seeds)
    if args.replay:
        from health_recovery_replay import replay_report  # noqa: PLC0415 (that mode only)

        return replay_report(runs, args, faults, seeds)
    summary = save(runs, args, faults, seeds)
    print_table(summary)
    print(f"\nraw figures: {results}")
    return 0


def save(runs: dict, args, faults: list[str], seeds: list[int]) -> dict:
    summary = summarize(runs, faults, seeds)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "python benchmarks/health_recovery.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "rules": args.rules if args.rules and args.rules != "the shipped defaults" else "the shipped defaults",
        "summary": summary,
        "runs": sorted(runs.values(), key=lambda r: r["name"]),
    }
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1, default=str))
    return summary


if __name__ == "__main__":
    sys.exit(main())
