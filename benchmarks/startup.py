"""Where `fleetrl run`'s start-up goes (issue 30, item 10): import times of the heavy modules each process
loads, then whole demo runs to "N processes ready", each in fresh interpreters.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--model models/demo-warm] [--data data/arith.jsonl]

Prints a table and saves benchmarks/results/startup.json. Run it on a quiet machine: a busy one inflates
every figure. It claims nothing by itself; compare before/after on the same box.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = ["torch", "transformers", "deepspeed", "fleetrl.app.cli", "fleetrl.broker.server.service",
           "fleetrl.rollout.server", "fleetrl.learner.train"]


def import_s(module: str) -> float:
    """Seconds a fresh interpreter takes to import ``module`` (interpreter start-up subtracted)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"import {module} failed: {out.stderr[-500:]}")
    return float(out.stdout.strip().splitlines()[-1])


def run_ready_s(model: str, data: str) -> dict[str, float]:
    """One `fleetrl run` of one step: seconds to "processes ready" (its own figure) and to exit (wall)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fleetrl.app.cli", "run", "--config", str(ROOT / "configs" / "demo.yaml"),
               "--run-dir", f"{tmp}/run", "--no-status", f"model.path={model}", f"data.train={data}",
               "learner.total_steps=1", "run.eval_interval=0"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
        wall = time.perf_counter() - t0
    m = re.search(r"processes ready in ([0-9.]+) s", out.stdout)
    if out.returncode != 0 or not m:
        raise SystemExit(f"fleetrl run failed ({out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
    return {"ready_s": float(m.group(1)), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="models/demo-warm",
                    help="a local model (demo.yaml's; or fleetrl init-model --preset tiny --out DIR)")
    ap.add_argument("--data", default="data/arith.jsonl", help="prompts (demo.yaml's; fleetrl init-data)")
    args = ap.parse_args()
    imports = {mod: statistics.median(import_s(mod) for _ in range(args.repeats)) for mod in IMPORTS}
    runs = [run_ready_s(args.model, args.data) for _ in range(args.repeats)]
    result = {"imports_s": imports, "run_ready_s": statistics.median(r["ready_s"] for r in runs),
              "run_wall_s": statistics.median(r["wall_s"] for r in runs), "repeats": args.repeats,
              "time": time.time()}
    for mod, s in imports.items():
        print(f"import {mod:<28} {s:6.2f} s")
    print(f"fleetrl run: ready in {result['run_ready_s']:.1f} s, one step and exit in {result['run_wall_s']:.1f} s "
          f"(median of {args.repeats})")
    out = ROOT / "benchmarks" / "results" / "startup.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
