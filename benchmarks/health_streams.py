"""Healthy metric streams across configurations, for the false-alarm figure (benchmarks/health_replay.py).

Each configuration is recorded as **segments**: one ``fleetrl run`` each, from a warm start that learns
(the demo's ~1.2M-parameter model, SFT to ~25% held-out on two-number addition; for the multi-turn
configuration a warm start of the same size on ``calc`` tool episodes, SFT to ~20% episode success),
with the shipped algorithm config (``configs/<algorithm>.yaml``), the configuration's staleness and
learning rate, a held-out evaluation every ``--eval-interval`` steps, and the health monitor on with
**every rule as an alert** (``RECORD_RULES``: no rollback changes the stream; the rules are judged
afterwards by replaying it, the live alerts are a cross-check) and the fleet screen on (so a healthy
group it would leave out shows in ``fleet/screened_groups``: the screen's false positives). Segments go
round-robin over the configurations (each gets ``--segment-steps`` steps a round, a new seed each
time) until each has its ``--steps``: a sweep stopped half-way has covered every configuration.

It is resumable: a finished segment leaves ``<workdir>/streams/<name>/seg-<k>/done.json`` and is never
run again; a segment killed half-way is run again from its start (its directory is kept aside as
``seg-<k>.partial-<time>``, not counted). After the rounds, the replay runs the rules (the shipped
defaults, and the candidate set ``--candidate-rules``) over every finished segment and writes
benchmarks/results/health_replay.json (per rule, per configuration) and
benchmarks/results/health_streams.json (the segments: steps, exit code, held-out curve, others' CPU).

| name | config | broker.max_staleness | learner.lr | task |
| --- | --- | --- | --- | --- |
| grpo-s0-lr1e-4 | grpo | 0 | 1e-4 | arithmetic |
| grpo-s4-lr1e-4 | grpo | 4 | 1e-4 | arithmetic |
| grpo-s2-lr5e-5 | grpo | 2 | 5e-5 | arithmetic |
| dapo-s2-lr1e-4 | dapo | 2 | 1e-4 | arithmetic |
| gspo-s8-lr1e-4 | gspo | 8 | 1e-4 | arithmetic |
| rloo-s1-lr1e-4 | rloo | 1 | 1e-4 | arithmetic |
| ppo-s2-lr1e-4 | ppo (GAE, critic) | 2 | 1e-4 | arithmetic |
| dpo-online-s1 | dpo_online | 1 | 1e-4 | arithmetic |
| multiturn-s2-lr1e-4 | multiturn (calc tool, 3 turns) | 2 | 1e-4 | calc |

Multi-turn at 1e-4 too: at 2 x 4 episodes a step (``--mt-groups 2``) the configs/multiturn.yaml LR 2e-4
(``multiturn-s2``, the first 4 x 4 sweep) collapsed 6 of 7 segments (reward ~0.3 -> 0 by step 10-36, held-out
23% -> 0%); at 1e-4 the seeds that collapsed first (101, 404) learned over 60 steps (23% -> 41%, 76%).
Its recorded segments are replayed with ``--extra`` (the healthy ones only).

LR 1e-4, not the demo's 2e-4: at 8 x 8 a step (the demo: 16 x 8 and dynamic sampling) GRPO and DAPO at 2e-4
slid from 23% to 15-17% held-out in 250 steps, RLOO at 1e-4 rose to 36-46%.

Arithmetic runs take ``--groups`` prompts x ``--group-size`` samples a step (8 x 8, the demo 16 x 8), 5 new
tokens; the multi-turn one 4 x 8 episodes of up to 3 turns (``--mt-groups``); every run warms the LR up over
20 steps (Adam's first full-LR steps wrecked the warm start: at 4 x 8 with no warm-up GRPO went 23% -> 1%
held-out in 50 steps, and the rules, still in their warm-up, saw nothing). A segment whose held-out
accuracy ends more than 5 points under its start is not healthy: it is reported apart, not counted.

The issue asks for >= 30,000 steps:

    nice -n 15 python benchmarks/health_streams.py --workdir runs/health-streams     # 9 x 3350 steps
    python benchmarks/health_streams.py --steps 20 --segment-steps 20 --only grpo-s0-lr1e-4   # a smoke run
    python benchmarks/health_streams.py --replay-only --workdir runs/health-streams    # figures from disk
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, prepare_multiturn, run_child, tail  # noqa: E402
from harness import prepare as prepare_demo
from health_replay import main as replay_main  # noqa: E402

CONFIGS = {  # name: (config, max_staleness, lr, task)
    "grpo-s0-lr1e-4": ("grpo", 0, 1e-4, "arithmetic"),
    "grpo-s4-lr1e-4": ("grpo", 4, 1e-4, "arithmetic"),
    "grpo-s2-lr5e-5": ("grpo", 2, 5e-5, "arithmetic"),
    "dapo-s2-lr1e-4": ("dapo", 2, 1e-4, "arithmetic"),
    "gspo-s8-lr1e-4": ("gspo", 8, 1e-4, "arithmetic"),
    "rloo-s1-lr1e-4": ("rloo", 1, 1e-4, "arithmetic"),
    "ppo-s2-lr1e-4": ("ppo", 2, 1e-4, "arithmetic"),
    "dpo-online-s1": ("dpo_online", 1, 1e-4, "arithmetic"),
    "multiturn-s2-lr1e-4": ("multiturn", 2, 1e-4, "calc"),  # was multiturn-s2 at 2e-4: see the docstring
}
RESULTS = ROOT / "benchmarks" / "results"
RECORD_RULES = (
    "[{name: non_finite}, {name: grad_spike}, {name: reward_drop, window: 30, threshold: 0.25, persist: 5}, "
    "{name: length_collapse, window: 10, threshold: 0.6}, {name: entropy_floor}, {name: mismatch_kl_ceiling}, "
    "{name: reward_hacking}, {name: server_poison}, {name: stale_weights}]"
)  # all alerts: the recorded stream is the run's own; the per-server rules (server_poison, stale_weights) judge
# groups, not the metric stream, so their false alarms are these live alerts (``live_alerts_by_rule``), not a replay
CANDIDATE = (
    '[{"name": "non_finite", "action": "rollback"}, {"name": "grad_spike", "action": "alert"}, '
    '{"name": "reward_drop", "action": "rollback", "window": 30, "threshold": 0.25, "persist": 5}, '
    '{"name": "length_collapse", "action": "rollback", "window": 10, "threshold": 0.6}, '
    '{"name": "entropy_floor", "action": "alert"}, {"name": "mismatch_kl_ceiling", "action": "rollback"}, '
    '{"name": "reward_hacking", "action": "rollback"}]'
)


def prepare(workdir: Path) -> dict[str, dict[str, str]]:
    """Both tasks' warm starts and data, built once into ``workdir`` (the demo's recipe for arithmetic)."""
    demo = prepare_demo(workdir, 0.25)
    calc = prepare_multiturn(workdir, 30.0)
    return {
        "arithmetic": {"model": demo["warm"], "train": demo["train"], "eval": demo["eval"]},
        "calc": {"model": calc["warm"], "train": calc["train"], "eval": calc["eval"]},
    }


def overrides(name: str, work: dict[str, str], steps: int, seed: int, args) -> list[str]:
    config, staleness, lr, task = CONFIGS[name]
    groups = args.mt_groups if task == "calc" else args.groups
    sets = [
        f"model.path={work['model']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.total_steps={steps}",
        "learner.max_minutes=0",
        f"broker.max_staleness={staleness}",
        f"learner.lr={lr}",
        "learner.warmup_steps=20",
        f"learner.groups_per_step={groups}",
        f"rollout.prompts_per_batch={groups}",
        f"rollout.group_size={args.group_size}",
        f"run.eval_interval={args.eval_interval}",
        f"run.eval_n={args.eval_n}",
        f"health.rules={RECORD_RULES}",
        "checkpoint.interval=0",
        "telemetry.log_level=WARNING",
        "run.learner_threads=1",
        "run.rollout_threads=1",  # no OMP spinning on a shared box
        f"learner.seed={seed}",
        f"rollout.seed={seed}",
        f"data.seed={seed}",
        "learner.device=cpu",
        "rollout.device=cpu",
    ]
    # arithmetic: the demo's reward, exact match, for every algorithm (configs/dpo_online.yaml's format terms are
    # for the random tiny model, and with them `fleetrl run` refuses the held-out probe: run.eval_success ambiguous)
    return sets + (["rollout.max_new_tokens=5", "rollout.rewards=[{name: exact}]"] if task == "arithmetic" else [])


def recorded(name: str, workdir: Path) -> list[dict]:
    """The finished segments of one configuration (their done.json), in order."""
    return [json.loads(p.read_text()) for p in sorted((workdir / "streams" / name).glob("seg-*/done.json"))]


def run_segment(name: str, k: int, work: dict[str, str], steps: int, args) -> dict:
    seg = Path(args.workdir) / "streams" / name / f"seg-{k:02d}"
    if seg.exists():  # a segment killed half-way: kept aside whole, run again from its start
        shutil.move(seg, seg.with_name(f"{seg.name}.partial-{int(time.time())}"))
    seed = args.seed + 101 * k
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        str(ROOT / "configs" / f"{CONFIGS[name][0]}.yaml"),
        "--run-dir",
        str(seg),
        "--no-status",
        *overrides(name, work, steps, seed, args),
    ]
    seg.mkdir(parents=True, exist_ok=True)
    log = seg / "run.log"
    print(f"[{name} seg {k}] {steps} steps, seed {seed}", flush=True)
    code, cpu = run_child(
        f"{name}-{k}",
        argv,
        log,
        args.timeout_min * 60,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
    )
    rows = read_rows(seg / "metrics.jsonl")
    done = max((int(r["step"]) for r in rows), default=0)
    curve = [(int(r["step"]), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    live = read_rows(seg / "events.jsonl")
    result = {
        "name": name,
        "segment": k,
        "seed": seed,
        "steps": done,
        "exit_code": code,
        "cpu": cpu,
        "eval_curve": curve,
        "groups": sum(r.get("batch/groups", 0) for r in rows),
        "screened_groups": sum(r.get("fleet/screened_groups", 0) for r in rows),
        "live_alerts": [{k: e[k] for k in ("step", "rule", "message")} for e in live],
        "command": "fleetrl " + " ".join(argv[3:]),
    }
    print(
        f"  exit {code}, {done} steps in {cpu['wall_s']:.0f} s ({cpu['own_cpu_s'] / max(done, 1):.3f} CPU-s a step), "
        f"others' CPU share {cpu['others_cpu_share']:.0%}, held-out {curve[0][1] if curve else '-'} -> "
        f"{curve[-1][1] if curve else '-'}",
        flush=True,
    )
    if code == 0 and done >= steps:
        (seg / "done.json").write_text(json.dumps(result, indent=1))
    else:
        print(f"  [{name} seg {k}] did not finish; its log ends with:\n{tail(log)}", flush=True)
    return result


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sweep(names: list[str], data: dict, args) -> None:
    """Round-robin segments until every configuration has its steps (or a segment fails twice)."""
    failures: dict[str, int] = {}
    while True:
        todo = [
            n
            for n in names
            if sum(s["steps"] for s in recorded(n, Path(args.workdir))) < args.steps and failures.get(n, 0) < 2
        ]
        if not todo:
            return
        for name in todo:
            segs = recorded(name, Path(args.workdir))
            left = args.steps - sum(s["steps"] for s in segs)
            result = run_segment(name, len(segs), data[CONFIGS[name][3]], min(left, args.segment_steps), args)
            if result["exit_code"] != 0 or result["steps"] < min(left, args.segment_steps):
                failures[name] = failures.get(name, 0) + 1


def healthy(seg: dict) -> bool:
    """A segment whose held-out accuracy ends (best of its last 2 evaluations) within 5 points of its start."""
    curve = [a for _, a in seg.get("eval_curve", [])]
    return len(curve) >= 2 and max(curve[-2:]) >= curve[0] - 0.05


def healthy_extra(path: Path) -> bool:
    """A run given by --extra: a sweep's segment (its done.json has the held-out curve) is judged like the sweep's
    own; any other run (a recovery bench's unfaulted run, a bare metrics.jsonl) is taken as healthy."""
    done = path / "done.json"
    seg = json.loads(done.read_text()) if done.exists() else {}
    return "eval_curve" not in seg or healthy(seg)


def replay(names: list[str], args) -> int:
    every = {n: recorded(n, Path(args.workdir)) for n in names}
    segments = {n: [s for s in segs if healthy(s)] for n, segs in every.items()}
    declined = {
        n: [(s["segment"], s["eval_curve"][0][1], s["eval_curve"][-1][1]) for s in segs if not healthy(s)]
        for n, segs in every.items()
    }
    if any(declined.values()):
        print(f"segments left out, held-out fell > 5 points (not healthy runs): {declined}")
    dirs = [str(Path(args.workdir) / "streams" / n / f"seg-{s['segment']:02d}") for n in names for s in segments[n]]
    extra = [p for p in args.extra if healthy_extra(Path(p))]
    if extra:
        print(
            f"also replayed: {len(extra)} other healthy runs ({len(args.extra) - len(extra)} left out: held-out fell)"
        )
        dirs += extra
    if not dirs:
        print("no finished segment to replay", file=sys.stderr)
        return 1
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "python benchmarks/health_streams.py " + " ".join(sys.argv[1:]),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "configurations": {
            n: {
                "config": CONFIGS[n][0],
                "max_staleness": CONFIGS[n][1],
                "lr": CONFIGS[n][2],
                "task": CONFIGS[n][3],
                "steps": sum(s["steps"] for s in segs),
                "segments": segs,
            }
            for n, segs in segments.items()
        },
        "declined": declined,
    }
    groups = sum(s.get("groups", 0) for segs in segments.values() for s in segs)
    screened = sum(s.get("screened_groups", 0) for segs in segments.values() for s in segs)
    report["screen"] = {
        "groups_trained": groups,
        "screened_groups": screened,
        "note": "healthy groups the fleet screen left out: its false positives",
    }
    report["live_alerts"] = sum(len(s.get("live_alerts", [])) for segs in segments.values() for s in segs)
    by_rule: dict[str, int] = {}
    for segs in segments.values():
        for seg in segs:
            for e in seg.get("live_alerts", []):
                by_rule[e["rule"]] = by_rule.get(e["rule"], 0) + 1
    report["live_alerts_by_rule"] = by_rule
    report["extra_replayed"] = extra
    report["steps_recorded"] = sum(s["steps"] for segs in segments.values() for s in segs)
    (RESULTS / f"health_streams{args.tag}.json").write_text(json.dumps(report, indent=1))
    print(
        f"fleet screen on the healthy runs: {screened:g} groups left out, {groups:g} trained; "
        f"live alerts (every rule an alert): {report['live_alerts']} {by_rule} over {report['steps_recorded']} steps"
    )
    print("\n== the shipped defaults")
    code = replay_main([*dirs, "--json", str(RESULTS / f"health_replay{args.tag}.json")])
    print("\n== the candidate set (the defaults, reward_hacking with every evidence: its accuracy divergence too)")
    return code or replay_main(
        [*dirs, "--rules", args.candidate_rules, "--json", str(RESULTS / f"health_replay_candidate{args.tag}.json")]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3350, help="learner steps per configuration (9 x 3350 > 30,000)")
    p.add_argument("--segment-steps", type=int, default=250, help="steps of one run (a round's share)")
    p.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configuration names")
    p.add_argument("--workdir", default="runs/health-streams")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--groups", type=int, default=8, help="prompts a step (arithmetic)")
    p.add_argument("--mt-groups", type=int, default=4, help="prompts a step (multi-turn)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-min", type=float, default=180.0, help="per segment")
    p.add_argument("--candidate-rules", default=CANDIDATE, help="JSON rule list replayed besides the defaults")
    p.add_argument("--replay-only", action="store_true")
    p.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="other healthy runs replayed with the segments (run dirs or metrics.jsonl: the 8 x 8 segments, the "
        "multi-turn run, unfaulted recovery runs); a segment dir with a done.json is left out if its held-out fell",
    )
    p.add_argument(
        "--tag",
        default="",
        help="suffix of the results files (e.g. _4x4: health_streams_4x4.json, health_replay_4x4.json)",
    )
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if not args.replay_only:
        sweep(names, prepare(Path(args.workdir)), args)
    return replay(names, args)


if __name__ == "__main__":
    raise SystemExit(main())
