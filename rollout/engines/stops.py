"""Where a response stops: the eos ids of a tokenizer and model, and stop strings found in decoded text."""

from __future__ import annotations

from collections.abc import Sequence

from fleetrl.rollout.engines.params import SamplingParams


def eos_token_ids(tokenizer, generation_eos: int | list[int] | None, params: SamplingParams) -> list[int]:
    """Token ids that end a response: the tokenizer's eos, the model's generation-config eos
    (an int or a list), and ``params.stop_token_ids``; sorted, without duplicates."""
    ids = set(params.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(generation_eos)
    return sorted(ids)


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest occurrence of any stop string in ``text``, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def stop_window(stops: Sequence[str]) -> int:
    """Trailing tokens whose text must contain a stop string completed by the newest token.

    Every non-special token of a byte-level vocabulary is at least one byte, so a stop string of b
    bytes spans at most b tokens, plus up to 3 for a multi-byte character cut at the window's
    start. (A special token inside a stop string can still hide it from the window; the final
    full-text pass in the engine catches that case.)
    """
    return max(len(s.encode("utf-8")) for s in stops) + 3
