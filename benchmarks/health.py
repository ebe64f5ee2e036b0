"""The circuit breaker, measured: faults injected into the demo, with the health rules as shipped.

Each run is ``fleetrl run --config configs/demo.yaml`` (broker, one HF rollout server on CPU, one
learner, gloo weight sync) from the demo's warm start (the ~1.2M-parameter ``small`` Qwen2,
`fleetrl sft --target-acc 0.25`, built once into ``--workdir`` and reused by every run), for ``--steps``
learner steps, held-out greedy accuracy on ``--eval-n`` problems every ``--eval-interval`` steps, a
checkpoint every ``--checkpoint-interval`` steps, and **no** ``health.*`` override: the defaults as
shipped. A fault run sets ``FLEETRL_FAULT*`` (``common/faults/plan.py``) so that the fault is active from
learner step / policy version ``--inject-at`` for ``--duration`` steps:

| kind | FLEETRL_FAULT | what goes wrong |
| --- | --- | --- |
| divergence | lr_spike | learning rate x50 |
| reward_hack | reward_hack | the reward pays 1 for an empty or one-character answer |
| non_finite | nan_reward,nan_grad | 25% of reward scores NaN, and every gradient NaN |
| stale_fleet | stale_fleet | the rollout server announces new versions but keeps sampling from the old weights |
| entropy_collapse | entropy_collapse | rollout temperature 0.1 (the learner still assumes 1.0) |

Per fault: detected?, the delay in steps from the injection to the first health event, the action the
monitor took, and whether the rollback recovered (held-out accuracy back within 3 points of the
pre-fault best within ``--recover-within`` steps of the rollback). Over ``--seeds`` healthy runs (no
fault, different ``learner.seed`` / ``rollout.seed``): alerts and rollbacks per 1,000 steps.

    python benchmarks/health.py [--faults divergence,non_finite] [--seeds 3] [--steps 120] [--workdir DIR]
    python benchmarks/health.py --analyze-only          # recompute the table from the runs on disk

Raw figures: benchmarks/results/health.json (merged with earlier runs of other faults / seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, prepare, run_child, tail  # noqa: E402
from health_analysis import detection, eval_curve, false_alarms, last_rollback_step, recovery, targets  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "health.json"
FAULTS = {
    "divergence": "lr_spike",
    "reward_hack": "reward_hack",
    "non_finite": "nan_reward,nan_grad",
    "stale_fleet": "stale_fleet",
    "entropy_collapse": "entropy_collapse",
}
START_MARGIN_S = 240  # start-up, evaluations and shutdown on top of the steps' own time


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_one(name: str, work: dict, args, seed: int, fault: str | None) -> dict:
    run_dir = Path(args.workdir) / "runs" / name
    if run_dir.exists():
        for p in sorted(run_dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        run_dir.rmdir()
    sets = [
        f"model.path={work['warm']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.total_steps={args.steps}",
        f"learner.max_minutes={args.max_minutes}",
        f"run.eval_interval={args.eval_interval}",
        f"run.eval_n={args.eval_n}",
        f"checkpoint.interval={args.checkpoint_interval}",
        "checkpoint.keep_last=3",
        f"learner.seed={seed}",
        f"rollout.seed={seed}",
        f"data.seed={seed}",
    ]
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
        env.update(
            FLEETRL_FAULT=FAULTS[fault], FLEETRL_FAULT_AT=str(args.inject_at), FLEETRL_FAULT_FOR=str(args.duration)
        )
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"[{name}] {args.steps} steps, seed {seed}"
        + (f", {fault} ({FAULTS[fault]}) at step {args.inject_at} for {args.duration}" if fault else ", no fault"),
        flush=True,
    )
    t0 = time.time()
    code, cpu = run_child(name, argv, log, 60 * args.max_minutes + START_MARGIN_S, env=env)
    result = {
        "name": name,
        "fault": fault,
        "seed": seed,
        "exit_code": code,
        "cpu": cpu,
        "wall_s": time.time() - t0,
        "run_dir": str(run_dir),
        "inject_at": args.inject_at if fault else None,
        "duration": args.duration if fault else None,
        "recover_within": args.recover_within,
        "command": (
            f"FLEETRL_FAULT={FAULTS[fault]} FLEETRL_FAULT_AT={args.inject_at:d} FLEETRL_FAULT_FOR={args.duration:d} "
            if fault
            else ""
        )
        + " ".join(["fleetrl", *argv[3:]]),
    }
    if not (run_dir / "metrics.jsonl").exists():
        result["error"] = f"no metrics.jsonl; log ends with:\n{tail(log)}"
    return {**result, **analyze_run(result)}


def analyze_run(result: dict) -> dict:
    """Figures of one run from its directory (so ``--analyze-only`` recomputes them)."""
    run_dir = Path(result["run_dir"])
    rows, events = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "events.jsonl")
    steps = max((int(r["step"]) for r in rows), default=0)
    out = {"steps": steps, "events": events, "curve": eval_curve(rows)}
    fleet = read_jsonl(run_dir / "rollout-0.metrics.jsonl")
    out["rollout_nonfinite_rewards"] = max((r.get("reward/nonfinite_total", 0) for r in fleet), default=0)
    if not result["fault"]:  # the shipped defaults of this checkout, replayed on the recorded metrics
        out["replayed_events"] = replay_defaults(rows)
    if result["fault"]:
        at = result["inject_at"]
        out["detection"] = detection(events, at)
        if result["exit_code"] == 3 and out["detection"]["detected"]:
            out["detection"]["action"] = "stop"
        rb = last_rollback_step(events, at)
        out["recovery"] = recovery(out["curve"], at, rb, result["recover_within"])
    return out


def replay_defaults(rows: list[dict]) -> list[dict]:
    """Health events the default rules of this checkout give on a run's recorded metrics (exact for a run
    without a rollback: the metrics do not depend on the rules then). Lets a changed default be judged
    on healthy runs recorded before the change."""
    import logging

    from fleetrl.common.config.learner import HealthConfig
    from fleetrl.learner.health import HealthMonitor

    logging.getLogger("fleetrl.learner.health").setLevel(logging.CRITICAL)
    monitor = HealthMonitor(HealthConfig(), None)
    events = []
    for r in rows:
        if r["step"] > 0:
            events += [{"step": e.step, "rule": e.rule, "action": e.action} for e in monitor.observe(r["step"], r)]
    return events


def summarize(runs: list[dict]) -> dict:
    faults = {
        r["fault"]: {k: r[k] for k in ("detection", "recovery", "steps", "exit_code", "rollout_nonfinite_rewards")}
        | {"others_cpu_share": r["cpu"]["others_cpu_share"]}
        for r in runs
        if r["fault"]
    }
    healthy = false_alarms([r for r in runs if not r["fault"]])
    healthy["replayed_with_current_defaults"] = false_alarms(
        [{"steps": r["steps"], "events": r.get("replayed_events", [])} for r in runs if not r["fault"]]
    )
    return {"faults": faults, "healthy": healthy, "targets": targets(faults, healthy)}


def print_table(summary: dict) -> None:
    print(
        f"\n{'fault':<18}{'detected':>9}{'delay':>7}  {'first rule':<22}{'action':<10}{'recovered':>10}"
        f"{'best->after':>14}{'load':>7}"
    )
    for kind, f in summary["faults"].items():
        d, rc = f["detection"], f["recovery"]
        delay = "-" if d["delay_steps"] is None else str(d["delay_steps"])
        acc = (f"{100 * rc['pre_fault_best']:.1f}->" if rc["pre_fault_best"] is not None else "?->") + (
            f"{100 * rc['accuracy_after']:.1f}" if rc.get("accuracy_after") is not None else "-"
        )
        print(
            f"{kind:<18}{'yes' if d['detected'] else 'NO':>9}{delay:>7}  {str(d['first_rule']):<22}{d['action']:<10}"
            f"{'yes' if rc['recovered'] else 'no':>10}{acc:>14}{f['others_cpu_share']:>7.2f}"
        )
    h = summary["healthy"]
    if h["steps"]:
        print(
            f"\nhealthy runs: {h['steps']} steps, {h['alerts']} alerts ({h['alerts_per_1000_steps']:.2f} / 1,000 steps), "
            f"{h['rollbacks']} rollbacks ({h['rollbacks_per_1000_steps']:.2f} / 1,000 steps), {h['stops']} stops; "
            f"by rule {h['events_by_rule']}"
        )
    for k, v in summary["targets"].items():
        print(f"  {k}: {v}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/health-bench")
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma list of " + ", ".join(FAULTS) + " (or none)")
    ap.add_argument("--seeds", type=int, default=5, help="healthy runs (seeds FIRST..FIRST+N-1); 0 for none")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--healthy-steps", type=int, default=None, help="steps of each healthy run (default --steps)")
    ap.add_argument("--inject-at", type=int, default=60)
    ap.add_argument("--duration", type=int, default=10, help="steps / versions the fault stays active")
    ap.add_argument("--recover-within", type=int, default=40)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--checkpoint-interval", type=int, default=10)
    ap.add_argument("--max-minutes", type=float, default=6.0)
    ap.add_argument("--analyze-only", action="store_true")
    args = ap.parse_args()
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = {r["name"]: r for r in previous.get("runs", [])}
    if args.analyze_only:
        runs = {n: {**r, **analyze_run(r)} for n, r in runs.items()}
    else:
        work = prepare(Path(args.workdir), 0.25)
        kinds = [k for k in args.faults.split(",") if k and k != "none"]
        unknown = [k for k in kinds if k not in FAULTS]
        if unknown:
            ap.error(f"--faults: unknown {unknown}; valid: {', '.join(FAULTS)}")
        for kind in kinds:
            runs[f"fault-{kind}"] = run_one(f"fault-{kind}", work, args, 0, kind)
        healthy_args = argparse.Namespace(**{**vars(args), "steps": args.healthy_steps or args.steps})
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            runs[f"healthy-{seed}"] = run_one(f"healthy-{seed}", work, healthy_args, seed, None)
    ordered = sorted(runs.values(), key=lambda r: (r["fault"] is None, r["name"]))
    summary = summarize(ordered)
    print_table(summary)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "python benchmarks/health.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "summary": summary,
        "runs": [{k: v for k, v in r.items()} for r in ordered],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nraw figures: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
