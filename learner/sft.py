"""`fleetrl sft`: a short supervised warm start on (prompt, answer) pairs, stopped early at a target
held-out accuracy.

A randomly initialised model never samples a correct answer, so RL from a checker alone has no
signal. The demo therefore starts from a model that is right some of the time (~25%), and RL must do
the improving. Loss: cross-entropy on the answer tokens and eos only (the prompt is context).
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch

from fleetrl.common.telemetry.logs import setup_logging
from fleetrl.learner.evaluate import EvaluateModel, require_evaluator

log = logging.getLogger("fleetrl.sft")


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def encode_pairs(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids, loss mask) per row, tokenized exactly as the rollout server does.

    A row with ``messages`` (a whole conversation: a multi-turn warm start) is built turn by turn as an
    episode is (``common/chat/codec.py``): assistant turns trained, observations and tool results not.
    Other rows: the raw prompt, then the answer and eos, all trained."""
    out = []
    codec = None
    for row in rows:
        if "messages" in row:
            if codec is None:
                from fleetrl.common.chat.codec import ChatCodec

                codec = ChatCodec(tokenizer)
            out.append(codec.encode_conversation(row["messages"]))
            continue
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt, answer, [1] * len(answer)))
    return out


def collate(pairs: list[tuple[list[int], list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask and labels (-100 outside the trained response tokens)."""
    L = max(len(p) + len(a) for p, a, _ in pairs)
    ids = torch.full((len(pairs), L), pad_id, dtype=torch.long)
    attn = torch.zeros(len(pairs), L, dtype=torch.long)
    labels = torch.full((len(pairs), L), -100, dtype=torch.long)
    for i, (p, a, mask) in enumerate(pairs):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.where(torch.tensor(mask) > 0, torch.tensor(a), -100)
    return ids, attn, labels


def held_out_accuracy(cfg, model, tokenizer, rows: list[dict], model_dir: str, evaluate_model: EvaluateModel) -> float:
    """Greedy held-out accuracy with the in-run evaluator (`rollout/eval.py: evaluate_model`, handed in by the
    application): ``cfg``'s rewards, stops and environment (whole episodes when it is multi-turn). Without a
    job config: the arithmetic task's exact answer within 6 new tokens."""
    if cfg is None:
        from fleetrl.common.config import load_config
        from fleetrl.common.config.schema import RewardSpec

        cfg = load_config(None, ["rollout.max_new_tokens=6", f"model.path={model_dir}"])
        cfg.rollout.rewards = [RewardSpec(name="exact")]
    return evaluate_model(model, tokenizer, rows, cfg, batch_size=len(rows))["eval/accuracy"]


def sft(
    model_dir: str,
    data: str,
    eval_data: str,
    out: str,
    target_acc: float,
    lr: float,
    batch_size: int,
    max_steps: int,
    eval_every: int,
    eval_n: int,
    seed: int,
    max_minutes: float,
    cfg=None,
    evaluate_model: EvaluateModel | None = None,
) -> dict:
    """``cfg``: a job whose ``rollout.env`` is multi-turn makes the early stop measure whole episodes.
    ``evaluate_model``: the held-out evaluator (``learner/evaluate.py``), handed in by the application."""
    evaluate_model = require_evaluator(evaluate_model, "the warm start's early stop")
    from transformers import AutoModelForCausalLM

    from fleetrl.common.chat.tokenizer import load_tokenizer

    t0 = time.monotonic()  # the budget counts loading and evaluation too: `--max-minutes 4` means 4 minutes
    deadline = t0 + max_minutes * 60
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code if cfg is not None else False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = encode_pairs(tokenizer, read_rows(data))
    held_out = read_rows(eval_data)[:eval_n]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    acc, step, history = 0.0, 0, []
    model.train()
    while step < max_steps:
        if time.monotonic() > deadline:
            log.info("sft: --max-minutes %g reached at step %d; saving the model as it is", max_minutes, step)
            break
        ids, attn, labels = collate(rng.sample(pairs, batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        # evaluate every eval_every steps, five times as often once half-way to the target
        every = max(1, eval_every // 5) if acc >= target_acc / 2 else eval_every
        if step % every == 0:
            acc = held_out_accuracy(cfg, model, tokenizer, held_out, model_dir, evaluate_model)
            history.append({"step": step, "loss": loss.item(), "accuracy": acc, "time_s": time.monotonic() - t0})
            log.info("sft step %d  loss %.3f  held-out greedy accuracy %.1f%%", step, loss.item(), 100 * acc)
            if acc >= target_acc:
                break
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    result = {"steps": step, "accuracy": acc, "seconds": time.monotonic() - t0, "history": history}
    (Path(out) / "sft_result.json").write_text(json.dumps(result, indent=1))
    return result


def main(args, evaluate_model: EvaluateModel | None = None) -> int:
    """`fleetrl sft` (``app/entries.py`` calls it with rollout's evaluator)."""
    setup_logging("sft", "INFO")
    torch.set_num_threads(args.threads) if args.threads else None
    cfg = None
    if args.config:
        from fleetrl.common.config import load_config

        cfg = load_config(args.config, args.overrides)
    result = sft(
        args.model,
        args.data,
        args.eval_data,
        args.out,
        args.target_acc,
        args.lr,
        args.batch_size,
        args.max_steps,
        args.eval_every,
        args.eval_n,
        args.seed,
        args.max_minutes,
        cfg,
        evaluate_model,
    )
    print(
        f"warm start: {result['steps']} steps in {result['seconds']:.0f} s, held-out greedy accuracy "
        f"{100 * result['accuracy']:.1f}% -> {args.out}"
    )
    return 0
