"""The TRL system of the peer benchmark (vs_trl.py): ``trl.GRPOTrainer`` on the demo's prompts with the demo's
settings (``TRL_MATCHED``), run as a child process of vs_trl.py (``--role trl``) under the same wall-time budget,
scored by fleetrl's in-run evaluator inside the measured time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

from curves import thin
from harness import (
    EVAL_N,
    GROUP_SIZE,
    LR,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    START_MARGIN_S,
    TEMPERATURE,
    demo_accuracy,
    run_child,
    tail,
)

VS_TRL = Path(__file__).resolve().with_name("vs_trl.py")  # the script the TRL child runs (--role trl)

# GRPOConfig fields that match the demo: one optimizer step = 16 prompts x 8 completions, on-policy, no KL.
TRL_MATCHED = dict(
    per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,  # TRL counts completions, not prompts
    gradient_accumulation_steps=1,
    num_generations=GROUP_SIZE,
    num_iterations=1,
    learning_rate=LR,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    adam_beta1=0.9,
    adam_beta2=0.999,
    max_grad_norm=1.0,
    beta=0.0,
    epsilon=0.2,
    loss_type="dapo",
    scale_rewards="group",  # no KL; token-mean; group-std advantages
    max_completion_length=MAX_NEW_TOKENS,
    temperature=TEMPERATURE,
    top_p=1.0,
    top_k=0,
    use_cpu=True,
    bf16=False,
    fp16=False,
    use_vllm=False,
    gradient_checkpointing=False,
)


def run_trl_child(work: dict, args) -> dict:
    if importlib.util.find_spec("trl") is None:
        return {
            "status": "skipped",
            "error": "TRL is not installed; `pip install -e '.[dev]'` brings the pinned version",
        }
    out = Path(args.workdir) / "runs" / f"trl-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        str(VS_TRL),
        "--role",
        "trl",
        "--workdir",
        str(args.workdir),
        "--minutes",
        str(args.minutes),
        "--eval-interval",
        str(args.eval_interval),
        "--seed",
        str(args.seed),
        "--trl-out",
        str(out),
        "--trl-threads",
        str(args.trl_threads),
        "--lr-decay",
        args.lr_decay,
    ]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log = out.with_suffix(".log")
    code, cpu = run_child("trl", argv, log, 60 * args.minutes + START_MARGIN_S, env)
    result_file = out / "result.json"
    if not result_file.exists():
        return {
            "status": "failed",
            "exit_code": code,
            "log": str(log),
            "cpu": cpu,
            "error": f"the TRL run wrote no result (exit code {code}); its log ends with:\n{tail(log)}",
        }
    return {**json.loads(result_file.read_text()), "exit_code": code, "log": str(log), "cpu": cpu}


def trl_config(out: Path, seed: int):
    """GRPOConfig matching configs/demo.yaml (TRL_MATCHED), stopped by the wall-time callback."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        seed=seed,
        **TRL_MATCHED,
        max_steps=1_000_000,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def make_budget_callback(
    seconds: float,
    eval_every: int,
    samples_per_step: int,
    tokenizer,
    rows: list,
    log_path: Path,
    decay_by_time: bool = False,
):
    """A TrainerCallback: held-out greedy accuracy every ``eval_every`` steps, stop after ``seconds``;
    ``decay_by_time``: before each step, lr = LR x (1 - the share of ``seconds`` used), fleetrl's
    ``learner.lr_decay_by: time`` with a linear schedule to 0 (TRL's own schedulers count steps)."""
    from transformers import TrainerCallback

    class WallTimeBudget(TrainerCallback):
        def __init__(self):
            self.t0, self.rows, self.eval_s, self.reward, self.progress = 0.0, [], 0.0, [], []
            self.lr = LR
            self.last = {"step": 0, "time_s": 0.0, "samples": 0}
            self.file = log_path.open("a", buffering=1)

        def _eval(self, model, step: int) -> None:
            t = time.monotonic()
            acc = demo_accuracy(model, tokenizer, rows)
            if step:
                self.eval_s += time.monotonic() - t
            row = {"step": step, "time_s": time.monotonic() - self.t0 if step else 0.0, "accuracy": acc}
            self.rows.append(row)
            self.file.write(json.dumps(row) + "\n")

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._eval(model, 0)  # the warm start, before the clock (fleetrl does the same)
            self.t0 = time.monotonic()

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if decay_by_time and optimizer is not None and self.t0:
                factor = max(0.0, 1.0 - (time.monotonic() - self.t0) / seconds)
                for group in optimizer.param_groups:  # the constant scheduler put LR back after the last step
                    group["lr"] = LR * factor
                self.lr = LR * factor

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.reward.append({"time_s": time.monotonic() - self.t0, "reward": float(logs["reward"])})

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.last = {
                "step": state.global_step,
                "time_s": time.monotonic() - self.t0,
                "samples": state.global_step * samples_per_step,
            }
            if state.global_step % eval_every == 0:
                self._eval(model, state.global_step)
                self.last["time_s"] = time.monotonic() - self.t0
            self.progress.append(dict(self.last))
            if time.monotonic() - self.t0 >= seconds:
                control.should_training_stop = True
            return control

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    return WallTimeBudget()


def trl_main(args) -> int:
    """Child process: train with TRL's GRPOTrainer for the budget; write result.json into --trl-out."""
    out = Path(args.trl_out)
    result = {"status": "failed"}
    try:
        result.update(trl_train(Path(args.workdir), out, args))
        result["status"] = "ok" if result["steps"] > 0 else "failed"
        return 0 if result["status"] == "ok" else 1
    except Exception as e:  # reported to the driver: one failed system must not lose the others
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        traceback.print_exc()
        return 1
    finally:
        (out / "result.json").write_text(json.dumps(result, indent=1))


def trl_train(workdir: Path, out: Path, args) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from fleetrl.learner.sft import read_rows

    warm = workdir / "models" / "demo-warm"
    train_rows, eval_rows = (
        read_rows(workdir / "data" / "arith.jsonl"),
        read_rows(workdir / "data" / "arith.eval.jsonl"),
    )
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in train_rows])

    def exact(completions, answer, **_):
        """The demo's `exact` reward: 1.0 when the stripped completion equals the answer."""
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(warm)
    eval_tokenizer = AutoTokenizer.from_pretrained(
        warm
    )  # the evaluator's engine sets padding_side; keep TRL's untouched
    budget = make_budget_callback(
        60 * args.minutes,
        args.eval_interval,
        PROMPTS_PER_STEP * GROUP_SIZE,
        eval_tokenizer,
        eval_rows[:EVAL_N],
        out / "curve.jsonl",
        decay_by_time=args.lr_decay == "time",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact,
        args=trl_config(out, args.seed),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[budget],
    )
    trainer.train()
    last = budget.last
    return {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "steps": last["step"],
        "samples": last["samples"],
        "wall_s": last["time_s"],
        "eval_s": budget.eval_s,
        "curve": budget.rows,
        "reward_mean": thin(budget.reward),
        "progress": thin([{"time_s": p["time_s"], "samples": p["samples"]} for p in budget.progress]),
        "final_weights_accuracy": demo_accuracy(trainer.model, eval_tokenizer, eval_rows[:EVAL_N]),
        "lr_decay": args.lr_decay,
        "last_lr": budget.lr,
        "command": "GRPOTrainer(GRPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in TRL_MATCHED.items()) + "))",
    }
