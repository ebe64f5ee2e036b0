"""Healthy metric streams across configurations, for the false-alarm figure (benchmarks/health_replay.py).

Each configuration is one ``fleetrl run`` of a shipped config (``configs/<algorithm>.yaml``) on the
tiny preset model (``fleetrl init-model --preset tiny``) and synthetic arithmetic (calc for the
multi-turn one), for ``--steps`` learner steps, with the health monitor **off** (so that no rollback
changes the stream; the rules are judged afterwards by replaying it), a held-out evaluation every
``--eval-interval`` steps, and the configuration's staleness and learning rate. The streams land in
``--workdir``/streams/<name>/metrics.jsonl; then the replay runs the default rules over all of them
and writes benchmarks/results/health_replay.json.

The configurations (``--only`` picks some by name):

| name | config | broker.max_staleness | learner.lr |
| --- | --- | --- | --- |
| grpo-s0 | grpo | 0 | 1e-4 |
| grpo-s4-lr3e-4 | grpo | 4 | 3e-4 |
| dapo-s2 | dapo | 2 | 1e-4 |
| gspo-s8 | gspo | 8 | 1e-4 |
| rloo-s1-lr3e-4 | rloo | 1 | 3e-4 |
| ppo-s2 | ppo (GAE, critic) | 2 | 1e-4 |
| dpo-online-s1 | dpo_online | 1 | 1e-4 |
| multiturn-s2 | multiturn (tool calls, 3 turns) | 2 | 1e-4 |

The issue asks for >= 30,000 steps: ``--steps 4000`` gives 32,000. Run it on a quiet box (each run is
a broker, a rollout server and a learner on CPU):

    python benchmarks/health_streams.py --steps 4000 --workdir /tmp/health-streams
    python benchmarks/health_streams.py --steps 20 --only grpo-s0          # a smoke run (~1 min)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from health_replay import main as replay_main  # noqa: E402
from vs_trl import ROOT, fleetrl_cli, run_child, tail  # noqa: E402

CONFIGS = {  # name: (config, max_staleness, lr, task)
    "grpo-s0": ("grpo", 0, 1e-4, "arithmetic"),
    "grpo-s4-lr3e-4": ("grpo", 4, 3e-4, "arithmetic"),
    "dapo-s2": ("dapo", 2, 1e-4, "arithmetic"),
    "gspo-s8": ("gspo", 8, 1e-4, "arithmetic"),
    "rloo-s1-lr3e-4": ("rloo", 1, 3e-4, "arithmetic"),
    "ppo-s2": ("ppo", 2, 1e-4, "arithmetic"),
    "dpo-online-s1": ("dpo_online", 1, 1e-4, "arithmetic"),
    "multiturn-s2": ("multiturn", 2, 1e-4, "calc"),
}
RESULTS = ROOT / "benchmarks" / "results" / "health_replay.json"


def prepare(workdir: Path) -> dict[str, dict[str, str]]:
    """The tiny model and both tasks' data, built once into ``workdir``."""
    model = workdir / "models" / "tiny"
    if not (model / "config.json").exists():
        fleetrl_cli("init-model", "--out", str(model), "--preset", "tiny")
    data = {}
    for task, stem in (("arithmetic", "arith"), ("calc", "calc")):
        train, held_out = workdir / "data" / f"{stem}.jsonl", workdir / "data" / f"{stem}.eval.jsonl"
        if not (train.exists() and held_out.exists()):
            fleetrl_cli("init-data", "--task", task, "--out", str(train), "--n", "20000", "--eval-n", "200")
        data[task] = {"model": str(model), "train": str(train), "eval": str(held_out)}
    return data


def record(name: str, work: dict[str, str], args) -> Path:
    config, staleness, lr, _ = CONFIGS[name]
    run_dir = Path(args.workdir) / "streams" / name
    if (run_dir / "metrics.jsonl").exists():
        (run_dir / "metrics.jsonl").rename(run_dir / f"metrics.{int(time.time())}.jsonl.old")
    sets = [
        f"model.path={work['model']}",
        f"data.train={work['train']}",
        f"data.eval={work['eval']}",
        f"learner.total_steps={args.steps}",
        f"broker.max_staleness={staleness}",
        f"learner.lr={lr}",
        f"run.eval_interval={args.eval_interval}",
        "run.eval_n=100",
        "health.enabled=false",
        "checkpoint.interval=0",
        f"learner.seed={args.seed}",
        f"rollout.seed={args.seed}",
        "learner.device=cpu",
        "rollout.device=cpu",
    ]
    argv = [
        sys.executable,
        "-m",
        "fleetrl.app.cli",
        "run",
        "--config",
        str(ROOT / "configs" / f"{config}.yaml"),
        "--run-dir",
        str(run_dir),
        "--no-status",
        *sets,
    ]
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {args.steps} steps: fleetrl {' '.join(argv[3:])}", flush=True)
    code, cpu = run_child(name, argv, log, args.timeout_min * 60, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    print(f"  exit {code}, others' CPU share {cpu.get('others_cpu_share', float('nan')):.0%}", flush=True)
    if code or not (run_dir / "metrics.jsonl").exists():
        print(f"  [{name}] failed; its log ends with:\n{tail(log)}", flush=True)
    return run_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000, help="learner steps per configuration")
    p.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configuration names")
    p.add_argument("--workdir", default="/tmp/fleetrl-health-streams")
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-min", type=float, default=240.0, help="per configuration")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    data = prepare(Path(args.workdir))
    runs = [record(n, data[CONFIGS[n][3]], args) for n in names]
    done = [str(r) for r in runs if (r / "metrics.jsonl").exists()]
    if not done:
        print("no stream was recorded", file=sys.stderr)
        return 1
    return replay_main([*done, "--json", str(args.json)])


if __name__ == "__main__":
    raise SystemExit(main())
