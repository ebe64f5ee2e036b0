"""``health_recovery.py --analyze-only --replay``: the detection this checkout's rules give on recorded recovery
runs, their metrics replayed (``health_replay.py``) through the rules they ran under. Detection only: what a
rollback at another step would have recovered is not in the recording."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgspec
import yaml
from health_analysis import detection
from health_recovery import print_table, summarize
from health_replay import read_stream, replay

from fleetrl.common.config.learner import HealthConfig


def replayed(run: dict, run_dir: Path, rules: str) -> dict:
    """A recorded run's first detection by this checkout's rules: its metrics replayed (health_replay.py) through
    ``rules`` (the health.rules it ran under), events up to the first one at or after the fault. Readable only
    when that is no later than the run's own first event (what follows a live rollback is another run)."""
    cfg = msgspec.convert({"rules": yaml.safe_load(rules)}, HealthConfig) if rules else HealthConfig()
    events = replay(read_stream(run_dir), cfg, 10)["events"]
    at = run["inject_at"]
    first = min((e["step"] for e in events if e["step"] >= at), default=None)
    live = detection(run["events"], at)
    live_step = at + live["delay_steps"] if live["detected"] else None
    readable = first is not None and (live_step is None or first <= live_step) or first is None and live_step is None
    kept = [e for e in events if first is not None and at <= e["step"] <= first]
    kept += [{**e, "rule": "rollback"} for e in kept if e["action"] in ("rollback", "stop")]
    return {**run, "events": kept if readable else run["events"], "replay_readable": readable, "exit_code": 0}


def replay_report(runs: dict, args, faults: list[str], seeds: list[int]) -> int:
    rules = args.rules if args.rules != "the shipped defaults" else ""
    out = {}
    for name, run in runs.items():
        run_dir = Path(args.workdir, "runs", name)
        if (run_dir / "metrics.jsonl").exists():
            out[name] = replayed(run, run_dir, rules)
    unreadable = sorted(n for n, r in out.items() if r["fault"] and not r["replay_readable"])
    summary = summarize(out, faults, seeds)
    print_table(summary)
    print(
        f"\n(replayed: detection only; the accuracy columns are the recorded runs', not what a rollback by the replayed rules would give. Not readable (a live event came first or the rule judges what a replay lacks): {unreadable})"
    )
    path = Path(args.results).with_name(Path(args.results).stem + "_replay.json")
    path.write_text(
        json.dumps(
            {
                "command": "python benchmarks/health_recovery.py " + " ".join(sys.argv[1:]),
                "time": time.strftime("%Y-%m-%d %H:%M"),
                "rules": args.rules,
                "summary": summary,
                "unreadable": unreadable,
            },
            indent=1,
            default=str,
        )
    )
    print(f"raw figures: {path}")
    return 0
