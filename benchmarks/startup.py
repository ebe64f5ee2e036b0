"""Where `fleetrl run`'s start-up goes (issue 30, item 10): import times of the heavy modules and of each
process's entry module (and which heavy packages each pulls in), then whole one-step runs of the demo job,
each process's phases from exec to ready (the ``start-up: ready`` line each logs), the first step and the exit.

    .venv/bin/python benchmarks/startup.py --label after [--repeats 3] [--tree DIR] [--model M] [--data D]
    .venv/bin/python benchmarks/startup.py --against OLD_CHECKOUT [--repeats 3]     # before/after, interleaved

``--tree DIR`` / ``--against DIR`` measure another checkout of fleetrl (e.g. the commit before a change) with
this venv: its folders are put first on PYTHONPATH (checked: the script refuses when the import does not
resolve there). ``--against`` measures it as ``before`` and ``--tree`` as ``after``, alternating run by run.
Prints a table and saves ``benchmarks/results/startup-<label>.json``; with both ``startup-before.json`` and
``startup-after.json`` present it prints them side by side. Every figure comes with the CPU share that other
processes took meanwhile (``others_cpu_share``): a figure counts only from a quiet box (< 0.10).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LIBS = ["torch", "transformers", "deepspeed", "datasets", "zmq", "opentelemetry.sdk.trace"]
ENTRIES = [
    "fleetrl.app.cli",
    "fleetrl.app.launch.run",
    "fleetrl.broker.server.service",
    "fleetrl.rollout.server",
    "fleetrl.learner.train",
]
# the same entry points in a tree from before the re-floor (issue 25), so that an A/B across it compares like with like
BEFORE_REFLOOR = {
    "fleetrl.app.cli": "fleetrl." + "common.cli",  # spelled in two parts: the re-floor's rewrite leaves it alone
    "fleetrl.app.launch.run": "fleetrl." + "common.launch.run",
    "fleetrl.broker.server.service": "fleetrl.broker.server",
}


def module_in(tree: Path, module: str) -> str:
    """``module``'s name in ``tree`` (a tree without app/ predates the re-floor)."""
    return module if (tree / "app").is_dir() else BEFORE_REFLOOR.get(module, module)


HEAVY = [
    "torch",
    "transformers",
    "deepspeed",
    "datasets",
    "pyarrow",
    "pandas",
    "matplotlib",
    "peft",
    "aiohttp",
    "math_verify",
    "opentelemetry.exporter.otlp.proto.http",
    "sympy",
    "rich",
]
READY_FILES = {"broker": "broker.json", "rollout-0": "rollout-0.ready", "learner": "learner.ready"}
STARTUP_LINE = re.compile(r"start-up: ready ([0-9.]+) s after exec \((.*)\)")


class Load:
    """The CPU share other processes took while we measured: machine busy time minus our children's."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        from fleetrl.common.telemetry.cpu import machine_busy_s

        return machine_busy_s()

    @staticmethod
    def _ours() -> float:  # every descendant we (and they) waited for, this process too
        c, s = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return c.ru_utime + c.ru_stime + s.ru_utime + s.ru_stime

    def others_share(self) -> float:
        wall = time.monotonic() - self.t0
        others = (self._busy() - self.busy0) - (self._ours() - self.ours0)
        return round(max(0.0, others) / max(1e-9, wall * (os.cpu_count() or 1)), 3)


def tree_env(tree: Path, scratch: Path) -> dict[str, str]:
    """The environment that imports fleetrl from ``tree``: its folders under a namespace package first on
    PYTHONPATH (ahead of this venv's editable install), unless ``tree`` is this checkout."""
    env = dict(os.environ)
    if tree.resolve() != ROOT:
        pkg = scratch / "pkg" / "fleetrl"
        pkg.mkdir(parents=True)
        for sub in ("common", "broker", "rollout", "learner", "app"):
            if (tree / sub).is_dir():
                (pkg / sub).symlink_to(tree / sub)
        env["PYTHONPATH"] = str(scratch / "pkg")
    code = "import os, fleetrl.common as c; print(os.path.realpath(os.path.dirname(c.__file__)))"
    where = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    if where.returncode != 0 or Path(where.stdout.strip()) != (tree / "common").resolve():
        raise SystemExit(f"fleetrl does not import from {tree} ({where.stdout.strip() or where.stderr[-300:]})")
    return env


def import_s(module: str, env: dict[str, str], cwd: Path) -> tuple[float, list[str]]:
    """Seconds a fresh interpreter takes to import ``module`` (its start subtracted), and the heavy packages
    that import pulled in."""
    code = (
        f"import sys, time, json; t = time.perf_counter(); import {module}; dt = time.perf_counter() - t; "
        f"print(json.dumps([dt, [h for h in {HEAVY!r} if h in sys.modules]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"import {module} failed: {out.stderr[-500:]}")
    dt, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return dt, heavy


def child_phases(run_dir: Path, t0: float) -> dict[str, dict]:
    """Per process: when its ready file appeared (s after `fleetrl run` was spawned), and from its log's
    ``start-up: ready`` line (where the tree logs one) its exec time and phases."""
    out = {}
    for name, ready in READY_FILES.items():
        entry: dict = {}
        try:
            entry["ready_at"] = round((run_dir / ready).stat().st_mtime - t0, 3)
        except OSError:
            pass
        log = run_dir / "logs" / f"{name}.log"
        m = STARTUP_LINE.search(log.read_text(errors="replace")) if log.exists() else None
        if m:
            total = float(m.group(1))
            entry["phases"] = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in m.group(2).split(", "))}
            if "ready_at" in entry:
                entry["exec_at"] = round(entry["ready_at"] - total, 3)
        out[name] = entry
    return out


def one_run(tree: Path, env: dict[str, str], model: str, data: str) -> dict:
    """One `fleetrl run` of the demo job for one step; every time in seconds after it was spawned."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            module_in(tree, "fleetrl.app.cli"),
            "run",
            "--config",
            str(tree / "configs" / "demo.yaml"),
            "--run-dir",
            str(run_dir),
            "--no-status",
            f"model.path={model}",
            f"data.train={data}",
            "data.eval=null",
            "learner.total_steps=1",
            "run.eval_interval=0",
        ]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree, env=env)
        lines = [(time.time() - t0, line.rstrip()) for line in proc.stdout]
        code, wall = proc.wait(), time.time() - t0
        text = "\n".join(line for _, line in lines)
        ready = next(
            (
                (at, float(m.group(1)))
                for at, line in lines
                if (m := re.search(r"processes ready in ([0-9.]+) s", line))
            ),
            None,
        )
        if code != 0 or ready is None:
            raise SystemExit(f"fleetrl run failed ({code}):\n{text[-1500:]}")
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
        return {
            "ready_line_at": round(ready[0], 3),
            "launcher_says_ready_s": ready[1],
            "first_step_at": round(rows[0]["time"] - t0, 3) if rows and "time" in rows[0] else None,
            "exit_at": round(wall, 3),
            "processes": child_phases(run_dir, t0),
        }


def median_run(runs: list[dict]) -> dict:
    """Field-wise medians of the runs (phases too)."""

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    out = {k: med([r[k] for r in runs]) for k in ("ready_line_at", "launcher_says_ready_s", "first_step_at", "exit_at")}
    procs = {}
    for name in READY_FILES:
        entries = [r["processes"].get(name, {}) for r in runs]
        p = {k: med([e.get(k) for e in entries]) for k in ("exec_at", "ready_at")}
        phases = [e.get("phases", {}) for e in entries]
        p["phases"] = {k: med([ph.get(k) for ph in phases]) for k in (phases[0] if phases else {})}
        procs[name] = p
    out["processes"] = procs
    return out


def render(result: dict) -> list[str]:
    lines = [
        f"[{result['label']}] tree {result['tree']} (median of {result['repeats']}; others' CPU share "
        f"{result['others_cpu_share']:.0%}{'' if result['others_cpu_share'] < 0.10 else ': NOT quiet'})",
        "  import (fresh interpreter)          s   heavy packages it loads",
    ]
    for mod, (s, heavy) in result["imports"].items():
        lines.append(f"    {mod:<32} {s:5.2f}   {', '.join(heavy) if mod.startswith('fleetrl') else ''}")
    r = result["run"]
    lines.append("  fleetrl run, demo job, 1 step (s after spawn)")
    for name, p in r["processes"].items():
        at = f"exec {p['exec_at']:5.2f}  " if p.get("exec_at") is not None else " " * 13
        ready = f"ready {p['ready_at']:5.2f}" if p.get("ready_at") is not None else ""
        phases = ", ".join(f"{k} {v:.2f}" for k, v in p["phases"].items())
        lines.append(f"    {name:<10} {at}{ready}  {phases}")
    lines.append(
        f"    'processes ready' printed at {r['ready_line_at']:.2f} (the launcher says {r['launcher_says_ready_s']:.2f} "
        f"after its checks); first step at {r['first_step_at'] or float('nan'):.2f}; exit at {r['exit_at']:.2f}"
    )
    return lines


def side_by_side(before: dict, after: dict) -> list[str]:
    rows = [("'processes ready' printed", "ready_line_at"), ("first step", "first_step_at"), ("exit", "exit_at")]
    out = ["  before -> after (s after spawn)"]
    for label, key in rows:
        b, a = before["run"].get(key), after["run"].get(key)
        if b is not None and a is not None:
            out.append(f"    {label:<28} {b:6.2f} -> {a:6.2f}")
    for name in READY_FILES:
        b, a = before["run"]["processes"][name].get("ready_at"), after["run"]["processes"][name].get("ready_at")
        if b is not None and a is not None:
            out.append(f"    {name + ' ready':<28} {b:6.2f} -> {a:6.2f}")
    for mod in ENTRIES:
        if mod in before["imports"] and mod in after["imports"]:
            out.append(f"    import {mod:<21} {before['imports'][mod][0]:6.2f} -> {after['imports'][mod][0]:6.2f}")
    out.append(f"    others' CPU share: before {before['others_cpu_share']:.0%}, after {after['others_cpu_share']:.0%}")
    return out


def measure(trees: dict[str, Path], repeats: int, model: str, data: str) -> dict[str, dict]:
    """Each tree's imports and runs, interleaved (A B A B ...) so that a change in the machine's load hits both;
    one result per label."""
    load = Load()
    with tempfile.TemporaryDirectory() as scratch:
        envs = {label: tree_env(tree, Path(scratch) / label) for label, tree in trees.items()}
        imports: dict[str, dict[str, list]] = {label: {m: [] for m in LIBS + ENTRIES} for label in trees}
        runs: dict[str, list[dict]] = {label: [] for label in trees}
        for _ in range(repeats):
            for label, tree in trees.items():
                for mod in LIBS + ENTRIES:
                    imports[label][mod].append(import_s(module_in(tree, mod), envs[label], tree))
        for _ in range(repeats):
            for label, tree in trees.items():
                runs[label].append(one_run(tree, envs[label], model, data))
    share = load.others_share()
    return {
        label: {
            "label": label,
            "tree": str(tree),
            "repeats": repeats,
            "imports": {m: (round(statistics.median(s for s, _ in v), 3), v[0][1]) for m, v in imports[label].items()},
            "run": median_run(runs[label]),
            "runs": runs[label],
            "others_cpu_share": share,
            "cpus": os.cpu_count(),
            "time": time.time(),
        }
        for label, tree in trees.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after", help="name of this measurement: saves startup-<label>.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", default=str(ROOT), help="the fleetrl checkout to measure (default: this one)")
    ap.add_argument(
        "--against",
        metavar="DIR",
        help="also measure this checkout as `before` (and --tree as `after`), interleaved, and print them side by side",
    )
    ap.add_argument("--model", default="models/demo-warm", help="a local model (demo.yaml's, or fleetrl init-model)")
    ap.add_argument("--data", default="data/arith.jsonl", help="prompts (demo.yaml's; fleetrl init-data)")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    trees = {"before": Path(args.against).resolve(), "after": tree} if args.against else {args.label: tree}
    model, data = (str(Path(p).resolve()) for p in (args.model, args.data))
    results = measure(trees, args.repeats, model, data)
    RESULTS.mkdir(exist_ok=True)
    for label, result in results.items():
        print("\n".join(render(result)))
        out = RESULTS / f"startup-{label}.json"
        out.write_text(json.dumps(result, indent=1))
        print(f"saved {out}")
    saved = {k: RESULTS / f"startup-{k}.json" for k in ("before", "after")}
    if any(k in results for k in saved) and all(p.exists() for p in saved.values()):
        pair = {k: results.get(k) or json.loads(p.read_text()) for k, p in saved.items()}
        print("\n".join(side_by_side(pair["before"], pair["after"])))


if __name__ == "__main__":
    main()
