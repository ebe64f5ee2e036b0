"""Refactors keep numbers: the loss and grad-norm sequence of every CPU config on a fixed seed.

For each job in ``configs/*.yaml`` (not the GPU recipes) a one-rank learner trains ``--steps`` steps
on the tiny model (built locally) with the broker's in-process twin. Before each step the script
pushes that step's groups, generated from a fixed seed at the learner's current policy version, so
the same inputs reach the learner whatever the code inside it does. Offline DPO reads its own
preference file (``fleetrl init-data --task arithmetic-preference``, fixed seed).

    python benchmarks/parity.py --out benchmarks/results/parity_after.json
    python benchmarks/parity.py --compare benchmarks/results/parity_before.json benchmarks/results/parity_after.json

The compare mode prints, per config and metric, the largest relative difference over the steps and
exits 1 when one exceeds ``--rtol`` (1e-6 by default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = (
    "actor/loss",
    "actor/grad_norm",
    "actor/pg_loss",
    "critic/grad_norm",
    "critic/value_loss",
    "dpo/loss",
    "actor/kl",
    "actor/entropy",
    "actor/approx_kl",
    "adv/abs_mean",
)
INFRA = [
    "learner.device=cpu",
    "sync.transport=filesystem",
    "checkpoint.interval=0",
    "run.eval_interval=0",
    "telemetry.exporter=none",
    "learner.max_minutes=null",
    "health.enabled=false",
]


def job_names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def make_groups(step: int, n: int, group_size: int, version: int, vocab: int):
    """``n`` groups of ragged random responses for ``step`` (seeded by the step), rewards that differ."""
    import numpy as np

    from fleetrl.common import messages as m

    rng = np.random.default_rng(1000 + step)
    out = []
    for g in range(n):
        responses, rewards = [], []
        for i in range(group_size):
            t = int(rng.integers(1, 6))
            responses.append((rng.integers(7, vocab, t), -rng.random(t) * 3.0))
            rewards.append(float((i + g + step) % 2) + 0.25 * float(rng.random()))
        out.append(
            m.build_group(f"s{step}-g{g}", f"0:{step * n + g}", version, rng.integers(7, vocab, 6), responses, rewards)
        )
    return out


def run_job(name: str, model_dir: str, pref: str, pref_eval: str, steps: int, tmp: Path) -> dict[str, list[float]]:
    import torch

    from fleetrl.broker.client.inproc import InprocBroker
    from fleetrl.common.config import load_config
    from fleetrl.learner.runtime import init_distributed
    from fleetrl.learner.train import Learner
    from tests.broker.conftest import make_state

    run_dir = tmp / name
    run_dir.mkdir()
    cfg = load_config(
        str(ROOT / "configs" / f"{name}.yaml"),
        [f"model.path={model_dir}", f"run.dir={run_dir}", f"learner.total_steps={steps}", *INFRA],
    )
    if cfg.data.preference:
        cfg = load_config(
            str(ROOT / "configs" / f"{name}.yaml"),
            [
                f"model.path={model_dir}",
                f"run.dir={run_dir}",
                f"learner.total_steps={steps}",
                *INFRA,
                f"data.preference={pref}",
                f"data.preference_eval={pref_eval}",
            ],
        )
    torch.manual_seed(0)
    dist = init_distributed(cfg)
    fleet = not cfg.data.preference
    broker = client = rollout = None
    if fleet:
        state = make_state(
            "broker.queue_capacity=100000",
            "broker.max_staleness=1000",
            "broker.accept_unleased=true",
            # the synthetic rewards below go to 1.25: a python reward declares no range for the broker's check
            "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:contains_answer'}}]",
            n_prompts=100000,
            vocab_size=263,
        )
        broker = InprocBroker(state)
        rollout = broker.client("r0", "rollout")
        rollout.connect()
        client = broker.client("learner-0", "learner")
        client.connect()
    learner = Learner(cfg, run_dir, client, dist)
    seq: dict[str, list[float]] = {}
    for step in range(steps):
        if fleet:
            groups = make_groups(step, cfg.learner.groups_per_step, cfg.rollout.group_size, learner.version, 263)
            acks = rollout.push_groups(groups)
            assert all(a.status == "accepted" for a in acks), acks
        stats = learner.train_step()
        for key in METRICS:
            if key in stats:
                seq.setdefault(key, []).append(float(stats[key]))
    learner.close()
    return seq


def measure(steps: int, only: list[str] | None) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fleetrl.common.data.tasks import init_data
    from fleetrl.learner.init_model import init_model

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = str(init_model(tmp / "tiny", preset="tiny", seed=0))
        pref, pref_eval = init_data("arithmetic-preference", str(tmp / "pref.jsonl"), 2000, 100, 0, 99)
        out = {}
        for name in only or job_names():
            out[name] = run_job(name, model_dir, str(pref), str(pref_eval), steps, tmp)
            print(
                f"{name:14s} "
                + "  ".join(f"{k}={v[-1]:.6g}" for k, v in out[name].items() if k in ("actor/loss", "actor/grad_norm")),
                flush=True,
            )
        return out


def rel(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(before: dict, after: dict, rtol: float) -> int:
    bad = 0
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"{name:14s} only in {'after' if name in after else 'before'}")
            continue
        for key in sorted(set(before[name]) & set(after[name])):
            worst = max(rel(a, b) for a, b in zip(before[name][key], after[name][key]))
            flag = "" if worst <= rtol else "  <-- differs"
            bad += worst > rtol and key in ("actor/loss", "actor/grad_norm", "critic/grad_norm", "dpo/loss")
            print(f"{name:14s} {key:22s} steps={len(after[name][key]):3d}  max rel diff {worst:.2e}{flag}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="config names (default: every configs/*.yaml)")
    ap.add_argument("--out", help="write the sequences here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before, after, args.rtol)
    import torch

    torch.set_num_threads(args.threads)
    out = measure(args.steps, args.only)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
