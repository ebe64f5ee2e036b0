"""GRPO, PPO (with a critic) and online DPO on the demo task: same warm start, same wall time, one after another.

Each algorithm is ``fleetrl run --config configs/demo.yaml`` (one rollout server, one learner, gloo
weight sync, ``broker.max_staleness`` 2, truncated IS) from the demo's warm start (the ~1.2M-parameter
``small`` Qwen2, `fleetrl sft --target-acc 0.25`), trained for ``--minutes`` of wall time with the
held-out greedy accuracy (500 problems) evaluated every ``--eval-interval`` learner steps inside that
time. Only the ``algorithm.*`` keys differ:

- ``grpo``: the demo as it ships (group-std advantages, ppo_clip, token-mean, no KL);
- ``ppo``: ``adv_estimator: gae`` (gamma 1, lambda 0.95, whitened) with a value model, a copy of the
  warm start plus a new head, trained by its own DeepSpeed engine (lr ``--critic-lr``, a few
  critic-only warm-up steps); no KL, like the demo;
- ``dpo-online``: ``algorithm.type: dpo`` (sigmoid, beta ``--dpo-beta``): each group's best and worst
  response by reward make a pair; tied groups give none.

    python benchmarks/algorithms.py [--minutes 4] [--workdir DIR] [--algorithms grpo,ppo,dpo-online]

Figures go to stdout, benchmarks/results/algorithms.json and benchmarks/results/algorithms.png.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import curve_from_metrics, finish_plot, summarize, two_panels  # noqa: E402  (curve summaries, child handling and the workdir are shared)
from harness import (  # noqa: E402
    EVAL_N,
    RESULTS,
    ROOT,
    START_MARGIN_S,
    _interrupt,
    final_weights_accuracy,
    prepare,
    run_child,
    tail,
)

ALGORITHMS = ("grpo", "ppo", "dpo-online")


def overrides(name: str, args) -> list[str]:
    if name == "grpo":
        return []
    if name == "ppo":
        return [
            "algorithm.adv_estimator=gae",
            "algorithm.gamma=1.0",
            "algorithm.lam=0.95",
            "algorithm.whiten_advantages=true",
            f"algorithm.critic.lr={args.critic_lr}",
            f"algorithm.critic.warmup_steps={args.critic_warmup}",
            "algorithm.critic.vf_coef=0.5",
            "algorithm.critic.cliprange_value=0.2",
        ]
    return [
        "algorithm=null",
        "algorithm.type=dpo",
        "algorithm.loss=sigmoid",
        f"algorithm.beta={args.dpo_beta}",
        "algorithm.dynamic_sampling=true",
    ]  # the demo's algorithm section is RL's: replaced whole


def run_algorithm(name: str, work: dict, args) -> dict:
    run_dir = Path(args.workdir) / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = [
        f"model.path={work['warm']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.max_minutes={args.minutes}",
        f"run.eval_interval={args.eval_interval}",
        f"run.eval_n={EVAL_N}",
        "checkpoint.interval=0",
        f"learner.seed={args.seed}",
        *overrides(name, args),
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
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"[{name}] training for {args.minutes:g} min; overrides: {' '.join(overrides(name, args)) or '(the demo as is)'}",
        flush=True,
    )
    code, cpu = run_child(name, argv, log, 60 * args.minutes + START_MARGIN_S)
    result = {"command": " ".join(["fleetrl", *argv[3:]]), "run_dir": str(run_dir), "exit_code": code, "cpu": cpu}
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {**result, "status": "failed", "error": f"no metrics.jsonl; log ends with:\n{tail(log)}"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    result.update(curve_from_metrics(rows))
    result["final_weights_accuracy"] = final_weights_accuracy(run_dir, work)
    result["extra"] = last_values(
        rows,
        (
            "critic/value_loss",
            "critic/explained_variance",
            "dpo/pairs",
            "dpo/tied_groups",
            "dpo/accuracy",
            "reward/mean",
        ),
    )
    result["status"] = "ok" if code == 0 and result["steps"] > 0 else "failed"
    if result["status"] == "failed":
        result["error"] = f"`fleetrl run` exited with {code}; its log ends with:\n{tail(log)}"
    return result


def last_values(rows: list[dict], keys: tuple[str, ...], last: int = 20) -> dict[str, float]:
    """Mean of each key over the last ``last`` learner steps that report it."""
    out = {}
    for key in keys:
        vals = [r[key] for r in rows if key in r][-last:]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def plot(results: dict[str, dict], budget_s: float, path: Path, title: str) -> None:
    fig, ax_acc, ax_r = two_panels()
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        curve = r["curve"]
        ax_acc.plot(
            [p["time_s"] for p in curve],
            [100 * p["accuracy"] for p in curve],
            marker="o",
            ms=3,
            label=f"{name} ({r['steps']} steps)",
        )
        ax_r.plot([p["time_s"] for p in r["reward_mean"]], [p["reward"] for p in r["reward_mean"]], lw=0.8, label=name)
    ax_acc.set(
        xlabel="training wall time (s)",
        ylabel="held-out greedy accuracy (%)",
        xlim=(0, budget_s * 1.02),
        title=f"accuracy over time ({EVAL_N} held-out problems)",
    )
    ax_r.set(
        xlabel="training wall time (s)",
        ylabel="mean reward of the trained batch",
        xlim=(0, budget_s * 1.02),
        title="training reward",
    )
    finish_plot(fig, (ax_acc, ax_r), title, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=4.0, help="training wall time per algorithm")
    ap.add_argument("--workdir", help="model, data, warm start and runs (reused when present; default: a new temp dir)")
    ap.add_argument(
        "--algorithms", default=",".join(ALGORITHMS), help=f"comma-separated subset of {', '.join(ALGORITHMS)}"
    )
    ap.add_argument("--eval-interval", type=int, default=20, help="learner steps between evaluations")
    ap.add_argument("--target-acc", type=float, default=0.25, help="warm-start accuracy (`fleetrl sft --target-acc`)")
    ap.add_argument("--critic-lr", type=float, default=2e-4)
    ap.add_argument("--critic-warmup", type=int, default=5, help="PPO critic-only steps before the policy moves")
    ap.add_argument("--dpo-beta", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "algorithms.json"), help="JSON results; the PNG goes next to it")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    names = [s.strip() for s in args.algorithms.split(",") if s.strip()]
    unknown = sorted(set(names) - set(ALGORITHMS))
    if unknown:
        ap.error(f"unknown algorithms {unknown}; valid: {', '.join(ALGORITHMS)}")
    args.workdir = str(Path(args.workdir or tempfile.mkdtemp(prefix="fleetrl-algorithms-")).resolve())
    print(f"workdir {args.workdir}", flush=True)
    try:
        work = prepare(Path(args.workdir), args.target_acc)
        results = {name: run_algorithm(name, work, args) for name in names}
    except KeyboardInterrupt:
        print(f"interrupted; runs are under {args.workdir}", file=sys.stderr)
        return 130
    budget_s = 60 * args.minutes
    table = {name: {**summarize(name, r, budget_s), **r.get("extra", {})} for name, r in results.items()}
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": " ".join(["python", "benchmarks/algorithms.py", *sys.argv[1:]]),
        "minutes_per_algorithm": args.minutes,
        "eval_interval_steps": args.eval_interval,
        "eval_n": EVAL_N,
        "workdir": work,
        "summary": table,
        "runs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    png = out.with_suffix(".png")
    plot(results, budget_s, png, f"demo task, same warm start, {args.minutes:g} min each, {report['machine']}")
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    print(
        f"\n{'algorithm':<11} {'steps':>6} {'samples/s':>10} {'start':>7} {'final':>7} {'best':>7} {'mean':>7} {'end':>7} {'others':>7}"
    )
    for name, s in table.items():
        if s["status"] != "ok":
            print(f"{name:<11} {s['status'].upper()}: {results[name].get('error', '')}")
            continue
        print(
            f"{name:<11} {s['steps']:>6} {s['samples_per_s']:>10.1f} {pct(s['start_accuracy']):>7} "
            f"{pct(s['final_accuracy']):>7} {pct(s['best_accuracy']):>7} {pct(s['mean_accuracy_over_budget']):>7} "
            f"{pct(s['final_weights_accuracy']):>7} {pct(s['others_cpu_share']):>7}"
        )
    print(
        "final = mean of the last two evaluations; mean = time-average of the curve; end = final weights after the "
        "clock stopped;\nothers = CPU share other processes took during the run (should be ~0%)"
    )
    print(f"saved {out} and {png}")
    return 0 if all(s["status"] == "ok" for s in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
