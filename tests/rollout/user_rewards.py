"""User reward functions that tests/rollout/test_rewards.py loads as ``tests.rollout.user_rewards:<name>``."""

from __future__ import annotations

import asyncio
import itertools
import threading

RELEASE = threading.Event()  # set by the tests to let a hung reward call return
CANCELLED: list[str] = []  # responses whose async call was cancelled at its deadline
NOT_CALLABLE = 3


def contains_answer(response: str, answer: str) -> float:
    return 1.0 if answer in response else 0.0


def scaled(response: str, answer: str, scale: float) -> float:
    return scale if response.strip() == answer else 0.0


def field_count(**fields) -> int:
    return len(fields)


def from_metadata(metadata: dict) -> float:
    return metadata["bonus"]


ASYNC_IN_FLIGHT = {"now": 0, "most": 0}  # async_len calls awaiting at once


async def async_len(response: str) -> int:
    ASYNC_IN_FLIGHT["now"] += 1
    ASYNC_IN_FLIGHT["most"] = max(ASYNC_IN_FLIGHT["most"], ASYNC_IN_FLIGHT["now"])
    try:
        await asyncio.sleep(0.01)
    finally:
        ASYNC_IN_FLIGHT["now"] -= 1
    return len(response)


def boom(response: str) -> float:
    raise ValueError(f"cannot score {response!r}")


def odd_values(response: str):
    return {"nan": float("nan"), "inf": float("inf"), "text": "1.0", "none": None, "ok": True}[response]


def hang_if_asked(metadata: dict) -> float:
    """Blocks (like a stuck HTTP call) until the test sets RELEASE, when ``metadata["hang"]``."""
    if metadata.get("hang"):
        RELEASE.wait(30)
    return 1.0


async def async_hang_if_asked(response: str, metadata: dict) -> float:
    if metadata.get("hang"):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            CANCELLED.append(response)
            raise
    return 1.0


def needs_unknown(response: str, reference: str) -> float:
    return 0.0


# ------------------------------------------------------------------ TRL's batched form, as its docs write it


def reward_func(completions, ground_truth, **kwargs):
    """TRL docs, "Using a custom reward function", example with a ground truth column."""
    import re

    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def multi_task_reward_func(prompts, completions, task, **kwargs):
    """TRL docs' multi-task example: None for the samples this function does not apply to."""
    rewards = []
    for _prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if completion.strip().endswith("4") else 0.0)
        else:
            rewards.append(None)
    return rewards


def none_per_sample(response: str):
    return None if response == "skip" else 1.0


def odd_rows_unscorable(prompt: str, response: str):
    """None (no score) for every response to a prompt whose first operand is odd: such groups cannot be scored."""
    return None if int(prompt[:2]) % 2 else 1.0


def no_score(response: str):
    return None  # never scores: a run on it has nothing to train on


def fails_late(response: str) -> float:
    """1.0, until the responses start with "late": then it raises, as a judge that went away mid-run."""
    if response.startswith("late"):
        raise ConnectionError("judge at http://judge:8000 went away")
    return 1.0


_CALLS = itertools.count()  # next() on a count is atomic under the GIL: safe from the scorer's worker threads


def works_then_breaks(response: str) -> float:
    """1.0 for the first 48 samples this process scores, then it raises (a reward that starts failing mid-run)."""
    if next(_CALLS) >= 48:
        raise ConnectionError("judge at http://judge:8000 went away")
    return 1.0
