"""What the benchmarks share: the demo's settings and workdir, their child processes, the CPU watch and the
held-out score every system gets.

- ``prepare(workdir, target_acc)``: the demo's model, data and warm start, built once (``fleetrl init-model``,
  ``init-data``, ``sft``) and reused;
- ``run_child(name, argv, log, timeout_s)``: one system's process, stopped by its handle on timeout, Ctrl-C
  or SIGTERM, with ``CpuWatch`` saying how much of the CPU other processes took meanwhile;
- ``demo_accuracy`` / ``final_weights_accuracy``: held-out greedy accuracy by fleetrl's in-run evaluator.

Used by vs_trl.py, floor.py, overlap.py, algorithms.py and the health benchmarks.
"""

from __future__ import annotations

import ctypes
import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


RESULTS = ROOT / "benchmarks" / "results"


# The demo's settings that the TRL run must match (configs/demo.yaml).
GROUP_SIZE = 8


PROMPTS_PER_STEP = 16


LR = 2.0e-4


MAX_NEW_TOKENS = 5


TEMPERATURE = 1.0


EVAL_N = 500


START_MARGIN_S = 900  # start-up, the step-0 evaluation and shutdown, on top of the training budget


BUSY_SHARE = 0.10  # others_cpu_share above which a run's timings are flagged as disturbed


# ------------------------------------------------------------------------------- workdir


def fleetrl_cli(*args: str, log: Path | None = None, timeout: float | None = None) -> None:
    """Run one `fleetrl` sub-command to completion; raise with its output's tail when it fails."""
    argv = [sys.executable, "-m", "fleetrl.app.cli", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(
            f"`fleetrl {' '.join(args)}` failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    print(f"  {lines[-1] if lines else f'fleetrl {args[0]}: done'}", flush=True)


def prepare(workdir: Path, target_acc: float) -> dict:
    """Model, data and warm start exactly as the demo builds them; steps whose output exists are skipped."""
    model, warm = workdir / "models" / "demo", workdir / "models" / "demo-warm"
    train, held_out = workdir / "data" / "arith.jsonl", workdir / "data" / "arith.eval.jsonl"
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        fleetrl_cli("init-model", "--out", str(model), "--preset", "small")
    if not (train.exists() and held_out.exists()):
        fleetrl_cli("init-data", "--task", "arithmetic", "--out", str(train), "--n", "20000", "--eval-n", str(EVAL_N))
    if not (warm / "sft_result.json").exists():
        fleetrl_cli(
            "sft",
            "--model",
            str(model),
            "--data",
            str(train),
            "--eval-data",
            str(held_out),
            "--out",
            str(warm),
            "--target-acc",
            str(target_acc),
            log=workdir / "logs" / "sft.log",
        )
    sft = json.loads((warm / "sft_result.json").read_text())
    print(
        f"  warm start {warm}: {sft['steps']} SFT steps, accuracy {sft['accuracy']:.1%} on the SFT's eval slice",
        flush=True,
    )
    return {
        "model": str(model),
        "warm": str(warm),
        "train": str(train),
        "eval": str(held_out),
        "sft_steps": sft["steps"],
        "sft_accuracy": sft["accuracy"],
    }


def prepare_multiturn(workdir: Path, sft_minutes: float) -> dict:
    """The multi-turn demo's model, calc data and warm start (scripts/multiturn_demo.sh's commands), cached like
    ``prepare``: ``{"warm", "train", "eval"}``."""
    model, warm = workdir / "models" / "multiturn", workdir / "models" / "multiturn-warm"
    train, held_out = workdir / "data" / "calc.jsonl", workdir / "data" / "calc.eval.jsonl"
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        fleetrl_cli("init-model", "--out", str(model), "--preset", "small")
    if not (train.exists() and held_out.exists()):
        fleetrl_cli("init-data", "--task", "calc", "--out", str(train), "--n", "20000", "--eval-n", "500")
    if not (warm / "config.json").exists():
        fleetrl_cli(
            "sft",
            *("--model", str(model), "--data", str(train), "--eval-data", str(held_out), "--out", str(warm)),
            *("--target-acc", "0.2", "--lr", "2e-4", "--eval-every", "10", "--eval-n", "100"),
            *("--max-minutes", str(sft_minutes), "--config", str(ROOT / "configs" / "multiturn.yaml")),
            log=workdir / "logs" / "sft-multiturn.log",
        )
    return {"warm": str(warm), "train": str(train), "eval": str(held_out)}


# ------------------------------------------------------------------------------ children


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the running system like Ctrl-C does


class CpuWatch:
    """How much other processes used the CPU while one system ran.

    ``others_cpu_share`` = (the machine's busy CPU time - the system's process tree's) / (wall time x
    cores): ~0 on a quiet machine, 0.5 when others kept half the cores busy. The tree's CPU time is
    the reaped children's rusage (threads and grandchildren included), so it is exact once the child
    has been waited for.
    """

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._children_cpu()

    @staticmethod
    def _busy() -> float:
        from fleetrl.common.telemetry.cpu import machine_busy_s

        return machine_busy_s()

    @staticmethod
    def _children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def result(self) -> dict:
        from fleetrl.common.telemetry.cpu import others_cpu_share

        wall, busy, own = time.monotonic() - self.t0, self._busy() - self.busy0, self._children_cpu() - self.own0
        return {
            "wall_s": wall,
            "own_cpu_s": own,
            "machine_busy_cpu_s": busy,
            "others_cpu_share": others_cpu_share(busy, own, wall),
        }


def run_child(name: str, argv: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[int, dict]:
    """Run one system's process to completion; on timeout, Ctrl-C or SIGTERM stop it by its handle (TERM, then KILL).

    The child also gets SIGTERM should this script be killed outright (PR_SET_PDEATHSIG). Returns the
    exit code and the CPU use (`CpuWatch`).
    """
    with log.open("w") as out:
        watch = CpuWatch()
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            preexec_fn=_die_with_parent,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  {name}: still running after {timeout_s:.0f} s; stopping it", flush=True)
            code = stop(proc)
        except KeyboardInterrupt:
            stop(proc)
            raise
        return code, watch.result()


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)  # `fleetrl run` stops its own children on SIGTERM
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode if proc.returncode is not None else -1


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------ held-out


def final_weights_accuracy(run_dir: Path, work: dict) -> float | None:
    """Greedy accuracy of the last checkpoint's HF export (written after the clock stopped)."""
    exports = sorted((run_dir / "checkpoints").glob("step-*/hf"))
    if not exports:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from fleetrl.learner.sft import read_rows

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(exports[-1], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(exports[-1])
    return demo_accuracy(model, tokenizer, read_rows(work["eval"])[:EVAL_N])


def demo_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Held-out greedy accuracy as every system is scored: fleetrl's in-run evaluator
    (`rollout/eval.py: evaluate_model`, what `run.eval_interval` calls) with configs/demo.yaml's sampling,
    stops and reward."""
    from fleetrl.common.config import load_config
    from fleetrl.rollout.eval import evaluate_model

    cfg = load_config(ROOT / "configs" / "demo.yaml", [])
    assert cfg.rollout.max_new_tokens == MAX_NEW_TOKENS, (
        "configs/demo.yaml and this benchmark disagree on max_new_tokens"
    )
    return evaluate_model(model, tokenizer, rows, cfg, batch_size=256)["eval/accuracy"]
