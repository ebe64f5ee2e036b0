"""User reward functions that tests/rollout/test_rewards.py loads as ``tests.rollout.user_rewards:<name>``."""

from __future__ import annotations

import asyncio
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
