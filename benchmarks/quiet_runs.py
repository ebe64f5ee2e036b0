"""Healthy runs stay quiet: the demo at several ``broker.max_staleness`` and the multi-turn demo, each for
``--steps`` learner steps with the default health rules (no ``health.*`` override), and what every rule
did. Also the two off-policy measures side by side, per staleness: ``off_policy/mismatch_kl`` (engine
against learner at the version that sampled the token: an engine or weight-sync fault) and
``off_policy/drift_kl`` (behaviour against the current weights: the honest price of staleness).

    python benchmarks/quiet_runs.py                                  # staleness 0,2,4,8 + multiturn, 300 steps
    python benchmarks/quiet_runs.py --configs s0,s2 --steps 100      # a subset
    python benchmarks/quiet_runs.py --check                          # exit 1 when any run had a health event

Each run is ``fleetrl run --config configs/<demo|multiturn>.yaml`` from the demos' warm starts (built once
into ``--workdir`` as the demos build them). Figures: benchmarks/results/quiet_runs.json (with others' CPU
share; these are counts, not speed figures, so a busy box changes the interleaving, not their meaning).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, prepare, prepare_multiturn, run_child, tail  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "quiet_runs.json"
DEFAULT_RULES = ("non_finite", "grad_spike", "reward_drop", "length_collapse", "entropy_floor", "mismatch_kl_ceiling")
CONFIGS = {  # name -> (config file, overrides)
    "s0": ("demo", ["broker.max_staleness=0"]),
    "s2": ("demo", ["broker.max_staleness=2"]),
    "s4": ("demo", ["broker.max_staleness=4"]),
    "s8": ("demo", ["broker.max_staleness=8"]),
    "multiturn": ("multiturn", []),
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def series(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if key in r]


def spread(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "p95": ordered[int(0.95 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def moving_max(values: list[float], window: int = 5) -> float | None:
    """The largest ``window``-step moving average: what the ceiling rules compare with their threshold."""
    if len(values) < window:
        return None
    return max(statistics.fmean(values[i : i + window]) for i in range(len(values) - window + 1))


def summarize(run_dir: Path) -> dict:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/step_total_s" in r]
    events = read_jsonl(run_dir / "events.jsonl")
    per_rule = dict.fromkeys(DEFAULT_RULES, 0)  # every default rule listed, with 0 when it never fired
    for e in events:
        per_rule[e["rule"]] = per_rule.get(e["rule"], 0) + 1
    curve = [r["eval/accuracy"] for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    mismatch = series(rows, "off_policy/mismatch_kl")
    return {
        "steps": len(rows),
        "events": len(events),
        "events_per_rule": per_rule,
        "event_lines": [f"step {e['step']} {e['rule']} -> {e['action']}: {e['message']}" for e in events][:20],
        "mismatch_kl": {**spread(mismatch), "ma5_max": moving_max(mismatch)},
        "drift_kl": {
            **spread(series(rows, "off_policy/drift_kl")),
            "ma5_max": moving_max(series(rows, "off_policy/drift_kl")),
        },
        "fresh_token_frac": spread(series(rows, "off_policy/fresh_token_frac")),
        "staleness_mean": spread(series(rows, "off_policy/staleness_mean")),
        "accuracy_first_last": [curve[0], curve[-1]] if curve else None,
    }


def run_one(name: str, work: dict, multi: dict | None, args) -> dict:
    config, extra = CONFIGS[name]
    run_dir = Path(args.workdir) / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = (
        [f"model.path={work['warm']}", f"data.train={work['train']}", f"data.eval={work['eval']}"]
        if config == "demo"
        else [f"model.path={multi['warm']}", f"data.train={multi['train']}", f"data.eval={multi['eval']}"]
    )
    overrides = [
        *paths,
        *extra,
        f"learner.total_steps={args.steps}",
        "learner.max_minutes=null",
        f"run.eval_interval={args.eval_interval}",
        f"run.eval_n={args.eval_n}",
        "checkpoint.export_hf=false",
        f"learner.seed={args.seed}",
        *args.set,
    ]
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        f"configs/{config}.yaml",
        "--run-dir",
        str(run_dir),
        "--no-status",
        *overrides,
    ]
    print(f"  {name}: fleetrl run {config} {' '.join(extra)} for {args.steps} steps -> {run_dir}", flush=True)
    code, cpu = run_child(name, argv, Path(args.workdir) / "logs" / f"{name}.log", timeout_s=args.timeout)
    if code != 0:
        print(tail(Path(args.workdir) / "logs" / f"{name}.log"), flush=True)
    out = {
        "config": config,
        "overrides": extra,
        "exit_code": code,
        "run_dir": str(run_dir),
        **cpu,
        **summarize(run_dir),
    }
    mk = out["mismatch_kl"]
    print(
        f"  {name}: exit {code}, {out['steps']} steps, {out['events']} health events, mismatch_kl mean "
        f"{mk.get('mean', float('nan')):.2e} (MA5 max {mk.get('ma5_max') or float('nan'):.2e}), drift_kl mean "
        f"{out['drift_kl'].get('mean', float('nan')):.4f}, fresh tokens {out['fresh_token_frac'].get('mean', 0):.0%}, "
        f"others' CPU {cpu['others_cpu_share']:.0%}",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "quiet"))
    ap.add_argument("--multiturn-sft-minutes", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    ap.add_argument("--set", action="append", default=[], help="an extra override for every run")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--check", action="store_true", help="exit 1 when a run failed or had any health event")
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    work = prepare(workdir, 0.25) if any(CONFIGS[n][0] == "demo" for n in names) else {}
    multi = prepare_multiturn(workdir, args.multiturn_sft_minutes) if "multiturn" in names else None
    runs = {name: run_one(name, work, multi, args) for name in names}
    result = {
        "steps": args.steps,
        "seed": args.seed,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": runs,
        "events_per_rule_total": {
            rule: sum(r["events_per_rule"].get(rule, 0) for r in runs.values())
            for rule in sorted({k for r in runs.values() for k in r["events_per_rule"]})
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"saved {args.out}; events per rule over all runs: {result['events_per_rule_total']}", flush=True)
    bad = [n for n, r in runs.items() if r["exit_code"] != 0 or r["events"] or r["steps"] < args.steps]
    if bad:
        print(f"not quiet: {bad}", flush=True)
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
