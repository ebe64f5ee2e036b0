"""False alarms of the health rules, measured on recorded healthy runs.

Replays each run's ``metrics.jsonl`` through the rules (the defaults of this checkout, or
``--rules``) exactly as the learner feeds them (``HealthMonitor.observe`` per step, ``on_checkpoint``
every ``--checkpoint-interval`` steps) and counts, per rule, the alerts and the rollbacks (actions
rollback and stop) it would have taken. A rollback in the replay resets the monitor's windows as a
real one would (the recorded stream goes on: it is healthy by construction). Rates are per 10,000
steps with the one-sided 95% upper bound of a Poisson count (exact; for 0 events it is the rule of
three, 3.0 / steps).

Record the streams with the health monitor off or alert-only (a rollback changes what follows); see
``benchmarks/health_streams.py``, which records them across configurations and then runs this.

    python benchmarks/health_replay.py RUN_DIR_OR_METRICS_JSONL ... [--json benchmarks/results/health_replay.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections import Counter
from pathlib import Path

import msgspec

from fleetrl.common.config.learner import HealthConfig, HealthRule
from fleetrl.learner.health import HealthMonitor

PER = 10_000


def poisson_upper(k: int, confidence: float = 0.95) -> float:
    """The exact one-sided upper bound on a Poisson mean after ``k`` events: P(X <= k | mu) = 1 - confidence."""
    if k < 0:
        raise ValueError(f"event count must be >= 0, got {k}")

    def cdf(mu: float) -> float:
        term = total = math.exp(-mu)
        for i in range(1, k + 1):
            term *= mu / i
            total += term
        return total

    lo, hi = 0.0, 10.0 + 10.0 * k
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - confidence else (lo, mid)
    return (lo + hi) / 2


def read_stream(path: Path) -> list[dict]:
    """The learner rows (step > 0) of a metrics.jsonl, or of ``RUN_DIR/metrics.jsonl``, in step order."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("step"), (int, float)) and r["step"] > 0]
    return sorted(rows, key=lambda r: r["step"])


def replay(rows: list[dict], cfg: HealthConfig, checkpoint_interval: int = 0) -> dict:
    """Events the rules give on one stream: {steps, alerts: Counter(rule), rollbacks: Counter(rule), events}."""
    monitor = HealthMonitor(cfg, None)
    alerts, rollbacks, events = Counter(), Counter(), []
    steps = 0
    for row in rows:
        step = int(row["step"])
        steps += 1
        fired = monitor.observe(step, {k: v for k, v in row.items() if isinstance(v, (int, float))})
        for e in fired:
            (alerts if e.action == "alert" else rollbacks)[e.rule] += 1
            events.append({"step": step, "rule": e.rule, "action": e.action, "message": e.message})
        if any(e.action != "alert" for e in fired):
            monitor.reset_after_rollback(step)
        if checkpoint_interval and step % checkpoint_interval == 0:
            monitor.on_checkpoint(step)
    return {"steps": steps, "alerts": alerts, "rollbacks": rollbacks, "events": events}


def rates(count: int, steps: int) -> dict:
    return {
        "count": count,
        "per_10k": PER * count / steps if steps else math.nan,
        "upper95_per_10k": PER * poisson_upper(count) / steps if steps else math.nan,
    }


def summarize(results: dict[str, dict], cfg: HealthConfig) -> dict:
    """Per rule (and for all rules together): alerts and rollbacks per 10,000 steps with the 95% bound."""
    steps = sum(r["steps"] for r in results.values())
    alerts, rollbacks = Counter(), Counter()
    for r in results.values():
        alerts.update(r["alerts"])
        rollbacks.update(r["rollbacks"])
    per_rule = {
        spec.name: {
            "action": spec.action,
            "alerts": rates(alerts[spec.name], steps),
            "rollbacks": rates(rollbacks[spec.name], steps),
        }
        for spec in cfg.rules
    }
    streams = {name: {"steps": r["steps"], "events": r["events"]} for name, r in results.items()}
    return {
        "steps": steps,
        "streams": streams,
        "rules": per_rule,
        "all": {"alerts": rates(sum(alerts.values()), steps), "rollbacks": rates(sum(rollbacks.values()), steps)},
    }


def print_table(summary: dict) -> None:
    print(f"{summary['steps']} healthy steps in {len(summary['streams'])} streams")
    print(f"{'rule':<28}{'action':<10}{'alerts':>8}{'/10k':>8}{'95% ub':>8}{'rollbacks':>11}{'/10k':>8}{'95% ub':>8}")
    for name, r in [*summary["rules"].items(), ("(all rules)", {"action": "", **summary["all"]})]:
        a, b = r["alerts"], r["rollbacks"]
        print(
            f"{name:<28}{r['action']:<10}{a['count']:>8}{a['per_10k']:>8.2f}{a['upper95_per_10k']:>8.2f}"
            f"{b['count']:>11}{b['per_10k']:>8.2f}{b['upper95_per_10k']:>8.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("streams", nargs="+", type=Path, help="run directories or metrics.jsonl files of healthy runs")
    p.add_argument(
        "--rules",
        default=None,
        help="JSON list of health rules to replay instead of the defaults, e.g. "
        '\'[{"name": "reward_hacking", "action": "rollback"}]\'',
    )
    p.add_argument("--checkpoint-interval", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    logging.getLogger("fleetrl.learner.health").setLevel(logging.CRITICAL)
    cfg = (
        HealthConfig()
        if args.rules is None
        else HealthConfig(rules=msgspec.convert(json.loads(args.rules), list[HealthRule]))
    )
    results = {}
    for path in args.streams:
        metrics = path / "metrics.jsonl" if path.is_dir() else path
        if not metrics.exists():
            print(f"no metrics.jsonl at {path}: pass a run directory or its metrics.jsonl", file=sys.stderr)
            return 2
        results[str(path)] = replay(read_stream(path), cfg, args.checkpoint_interval)
    summary = summarize(results, cfg)
    print_table(summary)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
