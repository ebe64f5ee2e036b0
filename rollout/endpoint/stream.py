"""``stream: true`` for the endpoint's routes: a finished response sent as OpenAI's server-sent events.

The reply is generated whole first (a session's tokens and a tool call's parse need the whole turn),
then written as the chunks an OpenAI server would send: per choice one chunk with the whole delta
(role, content, tool calls with their ``index``) and one with its ``finish_reason``; with
``stream_options.include_usage`` a last chunk with empty ``choices`` and the usage; then
``data: [DONE]``. Clients that only stream (many agent harnesses do) work unchanged; they see the
reply arrive at once rather than token by token.
"""

from __future__ import annotations

import json
from typing import Any


def chat_chunks(resp: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a finished ``chat.completion`` ``resp``."""
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    chunks = []
    for choice in resp["choices"]:
        msg = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(msg["tool_calls"])]
        chunks.append(
            {
                **head,
                "choices": [
                    {
                        "index": choice["index"],
                        "delta": delta,
                        "finish_reason": None,
                        "logprobs": choice.get("logprobs"),
                    }
                ],
            }
        )
        chunks.append(
            {**head, "choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
        )
    if include_usage:
        chunks.append({**head, "choices": [], "usage": resp["usage"]})
    return chunks


def completion_chunks(resp: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks of a finished ``text_completion`` ``resp`` (same object type, text per choice)."""
    head = {"id": resp["id"], "object": "text_completion", "created": resp["created"], "model": resp["model"]}
    chunks = [{**head, "choices": [{**choice}]} for choice in resp["choices"]]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": resp["usage"]})
    return chunks


async def send(request: Any, body: dict[str, Any], resp: dict[str, Any]) -> Any:
    """``resp`` as JSON, or as server-sent events when the call asked for ``stream: true``."""
    from aiohttp import web

    if not body.get("stream"):
        return web.json_response(resp)
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    chunks = (chat_chunks if resp["object"] == "chat.completion" else completion_chunks)(resp, include_usage)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    for chunk in chunks:
        await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
