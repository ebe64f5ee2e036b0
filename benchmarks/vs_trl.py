"""Peer benchmark: fleetrl (async), fleetrl (sync) and TRL's GRPOTrainer on the demo, same wall time.

The demo's task, model and warm start (two-number addition, the ~1.2M-parameter `small` Qwen2 built
locally, `fleetrl sft --target-acc 0.25`) are built once into ``--workdir`` (or reused from it). Then
three systems train from that same warm start for ``--minutes`` of wall time each, one after another
on this machine:

- ``fleetrl-async``: ``fleetrl run --config configs/demo.yaml`` (max_staleness 2, truncated IS);
- ``fleetrl-sync``:  the same with ``broker.max_staleness=0 algorithm.off_policy.mode=none``;
- ``trl``:           ``trl.GRPOTrainer`` on the same prompts (raw text, no chat template) with matched
  settings: 16 prompts x 8 completions per optimizer step, lr 2e-4 constant (``--lr-decay time``: linear to 0
  over the budget, for both), AdamW, grad clip 1.0,
  max 5 new tokens, temperature 1.0, no KL (beta 0), one pass per batch, token-mean loss ("dapo"),
  group-std advantages, fp32 on CPU, no vLLM.

Every system evaluates held-out greedy accuracy with fleetrl's in-run evaluator (`rollout/eval.py:
evaluate_model` under configs/demo.yaml: the same engine, 500 problems, 5 new tokens, the `exact` reward) every ``--eval-interval`` optimizer steps, inside the measured wall time
(fleetrl's `learner.max_minutes` counts its evaluations, so the TRL callback does too). The clock
starts when each trainer is ready and has scored the warm start (step 0); start-up is not counted.
Reported per system: samples/s (completions generated and trained per second of wall time), the
final accuracy (mean of the last two evaluations), the accuracy-over-time curve, plus an accuracy of
the final weights measured after the clock stopped, and how much of the CPU other processes took
meanwhile (timings taken on a busy machine are flagged, not comparable).

    python benchmarks/vs_trl.py [--minutes 5] [--workdir DIR] [--systems fleetrl-async,fleetrl-sync,trl]

Figures go to stdout, benchmarks/results/vs_trl.json and benchmarks/results/vs_trl.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import (  # noqa: E402
    SMOOTH,
    combine,
    curve_from_metrics,
    plot,
    plot_title,
    print_table,
    summarize,
    targets,
)
from harness import (  # noqa: E402
    EVAL_N,
    GROUP_SIZE,
    LR,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    RESULTS,
    ROOT,
    START_MARGIN_S,
    TEMPERATURE,
    _interrupt,
    final_weights_accuracy,
    prepare,
    run_child,
    tail,
)
from trl_system import TRL_MATCHED, run_trl_child, trl_main  # noqa: E402

SYSTEMS = ("fleetrl-async", "fleetrl-sync", "trl")
SYNC_OVERRIDES = ["broker.max_staleness=0", "algorithm.off_policy.mode=none"]
# --lr-decay: constant (the shared lr all along), or linear to 0 over the wall-time budget for every system
# (fleetrl: learner.lr_decay_by=time; TRL: the budget callback sets the same factor before each step)
LR_DECAY_OVERRIDES = {
    "constant": ["learner.lr_schedule=constant", "learner.warmup_steps=0"],
    "time": [
        "learner.lr_schedule=linear",
        "learner.lr_decay_by=time",
        "learner.min_lr_ratio=0",
        "learner.warmup_steps=0",
    ],
}


# ------------------------------------------------------------------------------- fleetrl


def run_fleetrl(system: str, work: dict, args) -> dict:
    run_dir = Path(args.workdir) / "runs" / f"{system}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = (
        [
            f"model.path={work['warm']}",
            f"data.train={work['train']}",
            f"data.eval={work['eval']}",
            f"learner.max_minutes={args.minutes}",
            f"run.eval_interval={args.eval_interval}",
            f"run.eval_n={EVAL_N}",
            "checkpoint.interval=0",  # TRL saves nothing either; the final checkpoint is written after the clock stops
            f"learner.seed={args.seed}",
            *LR_DECAY_OVERRIDES[args.lr_decay],  # the same schedule as TRL's, whatever configs/demo.yaml says
        ]
        + (SYNC_OVERRIDES if system == "fleetrl-sync" else [])
        + list(args.fleetrl_set)
    )
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
        *overrides,
    ]
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    code, cpu = run_child(system, argv, log, 60 * args.minutes + START_MARGIN_S)
    result = {
        "command": " ".join(["fleetrl", *argv[3:]]),
        "run_dir": str(run_dir),
        "log": str(log),
        "exit_code": code,
        "cpu": cpu,
    }
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {**result, "status": "failed", "error": f"no metrics.jsonl; `fleetrl run` log ends with:\n{tail(log)}"}
    result.update(curve_from_metrics([json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]))
    result["final_weights_accuracy"] = final_weights_accuracy(run_dir, work)
    result["status"] = "ok" if code == 0 and result["steps"] > 0 else "failed"
    if result["status"] == "failed":
        result["error"] = f"`fleetrl run` exited with {code}; its log ends with:\n{tail(log)}"
    return result


# -------------------------------------------------------------------------------- driver


def run_system(name: str, work: dict, args) -> dict:
    print(f"[{name}] training for {args.minutes:g} min from {work['warm']}...", flush=True)
    t = time.monotonic()
    try:
        result = run_trl_child(work, args) if name == "trl" else run_fleetrl(name, work, args)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # one system's failure is reported, the others still run
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
    result["elapsed_total_s"] = time.monotonic() - t
    if result.get("status") == "ok":
        print(
            f"[{name}] {result['steps']} steps, {result['samples']} samples in {result['wall_s']:.0f} s "
            f"({result['samples'] / max(result['wall_s'], 1e-9):.1f} samples/s)",
            flush=True,
        )
    else:
        print(f"[{name}] {result.get('status', 'failed').upper()}: {result.get('error', '')}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall time per system")
    ap.add_argument(
        "--workdir",
        help="model, data, warm start and run directories (reused when present; "
        "default: a new temporary directory, kept)",
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    ap.add_argument("--eval-interval", type=int, default=20, help="optimizer steps between evaluations (demo: 20)")
    ap.add_argument("--target-acc", type=float, default=0.25, help="warm-start accuracy (`fleetrl sft --target-acc`)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fleetrl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for both fleetrl runs, e.g. run.learner_threads=2 (repeatable)",
    )
    ap.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="torch threads of the TRL process (0 = torch's default: every core, as a user would run it)",
    )
    ap.add_argument(
        "--lr-decay",
        choices=sorted(LR_DECAY_OVERRIDES),
        default="constant",
        help="every system's schedule: constant lr, or linear decay to 0 over the --minutes budget (both systems)",
    )
    ap.add_argument("--out", default=str(RESULTS / "vs_trl.json"), help="JSON results; the PNG goes next to it")
    ap.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="summarize per-seed reports (each with fleetrl-async and trl): per seed and the median; runs nothing",
    )
    ap.add_argument("--role", default="driver", choices=["driver", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trl":
        return trl_main(args)
    if args.combine:
        return combine(args.combine)

    signal.signal(signal.SIGTERM, _interrupt)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown systems {unknown}; valid: {', '.join(SYSTEMS)}")
    args.workdir = str(Path(args.workdir or tempfile.mkdtemp(prefix="fleetrl-vs-trl-")).resolve())
    print(f"workdir {args.workdir}", flush=True)
    try:
        work = prepare(Path(args.workdir), args.target_acc)
        results = {name: run_system(name, work, args) for name in systems}
    except KeyboardInterrupt:
        print(
            f"interrupted: the running system was stopped; nothing saved (runs are under {args.workdir})",
            file=sys.stderr,
        )
        return 130

    budget_s = 60 * args.minutes
    table = {name: summarize(name, r, budget_s) for name, r in results.items()}
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": " ".join(["python", "benchmarks/vs_trl.py", *sys.argv[1:]]),
        "minutes_per_system": args.minutes,
        "eval_interval_steps": args.eval_interval,
        "eval_n": EVAL_N,
        "settings": {
            "group_size": GROUP_SIZE,
            "prompts_per_step": PROMPTS_PER_STEP,
            "lr": LR,
            "lr_decay": args.lr_decay,
            "fleetrl_lr_overrides": LR_DECAY_OVERRIDES[args.lr_decay],
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": TEMPERATURE,
            "kl": "none",
            "fleetrl_sync_overrides": SYNC_OVERRIDES,
            "fleetrl_extra_overrides": args.fleetrl_set,
            "trl_threads": args.trl_threads or "torch default",
            "trl": TRL_MATCHED,
            "eval_time": "included in the wall-time budget for every system",
        },
        "workdir": work,
        "summary": table,
        "targets": targets(table, results, budget_s),
        "runs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    png = out.with_suffix(".png")
    plot(results, budget_s, png, plot_title(report))
    print()
    print_table(table)
    for name, t in report["targets"].items():
        print(
            f"{name}: {'' if t['timings_comparable'] else '[NOT COMPARABLE: machine busy] '}"
            f"{t['samples_per_s_over_trl']:.2f}x TRL's samples/s (issue 24's target >= 1.0x: "
            f"{'met' if t['meets_1x_samples_per_s'] else 'NOT met'}); higher final accuracy: "
            f"{t['higher_final_accuracy']}; higher mean accuracy over time: {t['higher_mean_accuracy_over_budget']}"
        )
        if tt := t.get("time_to_trl_accuracy"):
            print(
                f"  time to TRL's end accuracy {tt['target']:.1%} ({SMOOTH}-evaluation trailing mean): {tt['mine_s']} s "
                f"vs TRL's {tt['trl_s']} s ({tt['speedup'] and round(tt['speedup'], 2)}x sooner)"
            )
    print(f"saved {out} and {png}")
    return 0 if all(s["status"] == "ok" for s in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
