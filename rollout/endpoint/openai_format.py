"""OpenAI's request and response fields, as the endpoint reads and writes them (pure functions).

number / stops / sampling    request fields -> checked values and our `SamplingParams` (400 on bad ones)
seen                         a session's reply text: its tokens decoded *with* their special tokens
reply / logprobs / usage     a `Generation` -> the assistant message (tool calls parsed), logprobs, usage
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from fleetrl.common.chat.codec import decode
from fleetrl.rollout.endpoint.sessions import ApiError, Session
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.engines.stops import find_stop


def number(body: dict[str, Any], key: str, default: Any, kind: type, lo: float, hi: float) -> Any:
    """``body[key]`` as an int or float within [lo, hi] (``default`` when absent or null); else ApiError 400."""
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(
            400, f"{key} must be a{'n integer' if kind is int else ' number'}, got {value!r}", "invalid_type", param=key
        )
    if not lo <= value <= hi:
        raise ApiError(400, f"{key}={value} is out of range [{lo:g}, {hi:g}]", "invalid_value", param=key)
    return kind(value)


def stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    out = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(out, list) or not all(isinstance(s, str) and s for s in out):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "invalid_value", param="stop")
    return tuple(out)


def sampling(body: dict[str, Any], session: Session | None, default_max: int) -> SamplingParams:
    """The call's sampling: in a session the rollout's own (the learner's log-probs assume it; only max_tokens and
    stop are honoured, within the session's budgets), else the request's temperature, top_p, seed."""
    requested = number(body, "max_completion_tokens", None, int, 1, 1 << 20) or number(
        body, "max_tokens", default_max, int, 1, 1 << 20
    )
    extra = stops(body)
    if session is not None:
        base = session.slot.params
        return dataclasses.replace(base, max_new_tokens=session.room(requested), stop=base.stop + extra)
    return SamplingParams(
        temperature=number(body, "temperature", 1.0, float, 0, 2),
        top_p=number(body, "top_p", 1.0, float, 1e-9, 1),
        max_new_tokens=requested,
        stop=extra,
        seed=number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1),
    )


def seen(gen: Generation, tokenizer: Any, params: SamplingParams) -> Generation:
    """``gen`` with the text a session's agent gets: its tokens decoded *with* their special tokens (a final stop
    token left out, cut before a stop string). A special token sampled mid-reply is trained, so the agent sees
    it too (rather than a text that hides what is trained)."""
    ids = list(gen.token_ids)
    if ids and gen.finish_reason == "stop" and ids[-1] in set(tokenizer.all_special_ids) | set(params.stop_token_ids):
        ids = ids[:-1]
    text = decode(tokenizer, ids)
    cut = find_stop(text, params.stop) if params.stop else -1
    return dataclasses.replace(gen, text=text[:cut] if cut >= 0 else text)


def reply(gen: Generation, tools: Any, parser: Callable[..., Any], counts: Counter[str]) -> tuple[dict[str, Any], str]:
    """The assistant message of a generation (tool calls parsed when the call has tools) and its finish reason."""
    finish = gen.finish_reason
    if tools:
        fns = [
            t["function"]
            for t in tools
            if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
        ]
        props = [
            (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
            for fn in fns
        ]
        params = {fn["name"]: list(p) if isinstance(p, dict) else [] for fn, p in zip(fns, props)}
        parsed = parser(gen.text, params)
        if parsed.malformed:
            counts["malformed_tool_calls"] += len(parsed.malformed)
        if parsed.calls:
            counts["tool_calls"] += len(parsed.calls)
            calls = [c.openai() for c in parsed.calls]
            return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, (
                "tool_calls" if finish == "stop" else finish
            )
    return {"role": "assistant", "content": gen.text}, finish


def logprobs(tokenizer: Any, gen: Generation) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": tokenizer.decode([t]),
                "logprob": lp,
                "bytes": list(tokenizer.decode([t]).encode()),
                "top_logprobs": [],
            }
            for t, lp in zip(gen.token_ids, gen.logprobs)
        ]
    }


def usage(ids: list[int], gens: list[Generation]) -> dict[str, int]:
    done = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": len(ids), "completion_tokens": done, "total_tokens": len(ids) + done}
