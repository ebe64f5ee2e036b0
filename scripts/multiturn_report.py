"""The multi-turn demo's figures from a run directory: held-out success before/after, turns per episode and
the share of well-formed tool calls over time (rollout metrics), the in-run eval curve; saved as summary.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def main(run: str) -> int:
    run_dir = Path(run)
    ev = {k: json.loads((run_dir / f"eval-{k}.json").read_text())["metrics"] for k in ("before", "after")}
    rollout = [r for r in lines(run_dir / "rollout-0.metrics.jsonl") if "env/turns_mean" in r]
    learner = lines(run_dir / "metrics.jsonl")
    t0 = min([r["time"] for r in rollout] + [r["time"] for r in learner if "time" in r], default=0)
    print("\nrollouts over time (30 s bins): turns per episode, well-formed tool calls, reward")
    bins: dict[int, list[dict]] = {}
    for r in rollout:
        bins.setdefault(int((r["time"] - t0) // 30), []).append(r)
    over_time = []
    for b, rows in sorted(bins.items()):
        mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        row = {
            "t_s": 30 * b,
            "turns_mean": mean("env/turns_mean"),
            "wellformed_frac": mean("env/tool_calls_wellformed_frac"),
            "reward_mean": mean("reward/mean"),
        }
        over_time.append(row)
        print(
            f"  {row['t_s']:4d} s  turns {row['turns_mean']:.2f}  well-formed {100 * row['wellformed_frac']:5.1f}%  "
            f"reward {row['reward_mean']:.3f}"
        )
    curve = [(r["step"], r["time"] - t0, r["eval/accuracy"]) for r in learner if "eval/accuracy" in r]
    if curve:
        print("\nheld-out greedy episode success during RL (in-process eval):")
        for step, t, a in curve:
            print(f"  step {step:5d}  {t:6.0f} s  {100 * a:5.1f}%  " + "#" * int(60 * a))
    b, a = ev["before"], ev["after"]
    print(
        f"\nheld-out success before RL {100 * b['eval/accuracy']:.1f}%  ->  after RL {100 * a['eval/accuracy']:.1f}%"
        f"  ({100 * (a['eval/accuracy'] - b['eval/accuracy']):+.1f} points)"
    )
    for key in ("eval/turns_mean", "eval/tool_calls_wellformed_frac"):
        print(f"  {key[5:]:28s} {b.get(key, float('nan')):.3f} -> {a.get(key, float('nan')):.3f}")
    summary = {
        "before": b,
        "after": a,
        "over_time": over_time,
        "eval_curve": curve,
        "gain_points": 100 * (a["eval/accuracy"] - b["eval/accuracy"]),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
