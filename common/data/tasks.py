"""Synthetic prompt sets with verifiable answers (`fleetrl init-data`).

``arithmetic``: addition of two numbers in ``[0, max_operand]``, zero-padded so every prompt has the
same length (``07+58=`` -> ``65``). Equal-length prompts keep position ids identical between
generation and training without any left-padding bookkeeping. The held-out split is drawn first and
the training split never contains one of its problems.

``calc``: products of two two-digit numbers (``37*48=`` -> ``1776``), for the multi-turn demo; the
training rows also carry ``messages``, the tool conversation the warm start learns the format from.

``arithmetic-preference``: the same problems as preference pairs for offline DPO,
``{prompt, chosen, rejected, answer}`` with the correct sum chosen and a wrong one rejected: the
correct sum plus a nonzero offset in [-9, 9] (a units-digit slip, sometimes with a carry error),
never negative.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Iterator

TASKS: dict[str, Callable[..., Iterator[tuple[str, str]]]] = {}


def _task(name: str):
    def wrap(fn):
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = fn
        return fn

    return wrap


@_task("arithmetic")
def arithmetic_problems(max_operand: int = 99) -> Iterator[tuple[str, str]]:
    """Every (prompt, answer) pair ``a+b=`` with zero-padded operands, in a fixed order."""
    width = len(str(max_operand))
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            yield f"{a:0{width}d}+{b:0{width}d}=", str(a + b)


@_task("calc")
def calc_problems(max_operand: int = 99) -> Iterator[tuple[str, str]]:
    """Products of two numbers in ``[10, max_operand]`` (``37*48=`` -> ``1776``): too hard for a small model
    to compute, easy with the ``calc`` tool (``configs/multiturn.yaml``)."""
    for a in range(10, max_operand + 1):
        for b in range(10, max_operand + 1):
            yield f"{a}*{b}=", str(a * b)


def calc_conversation(prompt: str, answer: str) -> list[dict[str, str]]:
    """The warm start's conversation of a calc problem: call the tool (pythonic format), read it, answer."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": f'calc("{prompt.rstrip("=")}")'},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


CONVERSATIONS: dict[str, Callable[[str, str], list[dict[str, str]]]] = {"calc": calc_conversation}
"""Tasks whose training rows also carry ``messages``: the tool conversation a warm start trains on."""

PREFERENCE_TASKS: dict[str, str] = {"arithmetic-preference": "arithmetic"}  # pair task -> its prompt task


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong sum: ``answer`` plus a nonzero offset in [-9, 9], never negative."""
    value = int(answer)
    return str(value + rng.choice([d for d in range(-9, 10) if d and value + d >= 0]))


def to_preference(rows: list[dict], seed: int) -> list[dict]:
    """(prompt, answer) rows -> preference rows: the correct answer chosen, a wrong one rejected."""
    rng = random.Random(seed)
    return [{"id": r["id"], "prompt": r["prompt"], "chosen": r["answer"], "rejected": wrong_answer(r["answer"], rng),
             "answer": r["answer"]} for r in rows]


def make_splits(task: str, n: int, eval_n: int, seed: int, **kwargs) -> tuple[list[dict], list[dict]]:
    """Train rows (sampled with replacement from the non-held-out problems) and held-out eval rows."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(sorted(TASKS))}")
    problems = list(TASKS[task](**kwargs))
    if eval_n >= len(problems):
        raise ValueError(f"eval_n={eval_n} leaves no training problems (the task has {len(problems)}); lower --eval-n")
    rng = random.Random(seed)
    rng.shuffle(problems)
    held_out, pool = problems[:eval_n], problems[eval_n:]
    if n <= len(pool):
        train = rng.sample(pool, n)
    else:
        train = [pool[i % len(pool)] for i in range(n)]
        rng.shuffle(train)
    to_rows = lambda items, split: [  # noqa: E731
        {"id": f"{split}-{i}", "prompt": p, "answer": a} for i, (p, a) in enumerate(items)
    ]
    return to_rows(train, "train"), to_rows(held_out, "eval")


def eval_path(train_path: str | Path) -> Path:
    """Where the held-out split of ``data/x.jsonl`` goes: ``data/x.eval.jsonl``."""
    p = Path(train_path)
    return p.with_name(p.stem + ".eval" + (p.suffix or ".jsonl"))


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return p


def init_data(task: str, out: str, n: int, eval_n: int, seed: int, max_operand: int) -> tuple[Path, Path]:
    train, held_out = make_splits(PREFERENCE_TASKS.get(task, task), n, eval_n, seed, max_operand=max_operand)
    if task in PREFERENCE_TASKS:
        train, held_out = to_preference(train, seed), to_preference(held_out, seed + 1)
    if task in CONVERSATIONS:
        train = [{**r, "messages": CONVERSATIONS[task](r["prompt"], r["answer"])} for r in train]
    return write_jsonl(train, out), write_jsonl(held_out, eval_path(out))


def main(args) -> int:
    train, held_out = init_data(args.task, args.out, args.n, args.eval_n, args.seed, args.max_operand)
    kind = "preference pairs" if args.task in PREFERENCE_TASKS else "prompts"
    print(f"wrote {args.n} training {kind} to {train} and {args.eval_n} held-out {kind} to {held_out}")
    return 0
