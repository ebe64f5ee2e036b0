"""How one call's response goes out: JSON, or (``stream: true``) OpenAI's server-sent events.

A streamed call without ``tools`` gets its text **as the tokens are sampled**: the engine hands each
request's new tokens to ``Request.on_token`` (`Sender.watch`), and a pump writes one
``chat.completion.chunk`` (or ``text_completion`` chunk) per batch of new text. The text sent trails
the sampled tokens by one token (the newest may be the stop token, which is never shown) and, with stop
strings, by the longest stop string (so a stop string is never sent); an incomplete UTF-8 character waits
for its next byte. When the generation ends, the rest of the final text follows, then one chunk per
choice with its ``finish_reason``, with ``stream_options.include_usage`` a last chunk with the usage, and
``data: [DONE]``. A call with ``tools`` streams the text before the parser's tool-call marker (hermes:
``<tool_call>``; ``parsers.STREAM_MARKERS``) the same way, less trailing whitespace (a reply with a call
has its content stripped); then each call streams as OpenAI's do: a ``tool_calls`` delta with its index,
id, type and name once the name has been sampled, then pieces of its ``arguments`` text as they are
sampled (``tool_stream``; the pieces are the model's own text, so they add up to the JSON it wrote). At
the end the calls are parsed from the whole turn as in a reply that does not stream: the rest of a
streamed call's arguments follows, then the calls that could not stream (written in another shape) whole,
and the finished reply carries the streamed ids and arguments text. A streamed call the finished turn does
not confirm (its JSON never closed, or the parser reads it otherwise) cannot be taken back: it is counted
(``stream_calls_unconfirmed``), logged, and a session accepts the reply back either as the client
assembled it or as parsed. A reply that starts with whitespace, a parser without a marker (pythonic,
json: the whole turn is one call or content) and a replayed session call send the finished reply at once.
A failure after the first event is sent as an event ``{"error": {...}}`` (the HTTP status is already 200).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fleetrl.rollout.endpoint.sessions import ApiError
from fleetrl.rollout.endpoint.tool_stream import partial_calls
from fleetrl.rollout.engines.stops import find_stop
from fleetrl.rollout.envs.parsers import ToolCall

log = logging.getLogger("fleetrl.rollout.endpoint")


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


def safe_prefix(text: str, stops: Sequence[str]) -> str:
    """What of a partial reply's ``text`` may be sent: cut at a stop string, else short of the longest one (it
    may be completing), and without a trailing incomplete UTF-8 character."""
    cut = find_stop(text, stops)
    if cut >= 0:
        return text[:cut]
    if stops:
        text = text[: max(0, len(text) - max(map(len, stops)) + 1)]
    return text.rstrip("\ufffd")


class Sender:
    """One call's response (see the module docstring). ``kind``: "chat" or "text"; ``decode(ids)``: the text
    a list of sampled tokens shows (the same rule as the final reply's)."""

    def __init__(
        self,
        request: Any,
        body: dict[str, Any],
        kind: str,
        model: str,
        decode: Callable[[list[int]], str],
        tool_marker: str | None = None,
        on_unconfirmed: Callable[[dict[str, Any]], None] | None = None,
    ):
        """``on_unconfirmed(message)``: a streamed reply whose calls the finished turn did not confirm, as the
        client assembled it (a session accepts it back)."""
        self.request, self.body, self.kind, self.decode = request, body, kind, decode
        self.on_unconfirmed = on_unconfirmed
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{os.urandom(16).hex()}"
        self.created, self.model = int(time.time()), model
        self.streaming = body.get("stream") is True
        # with tools, only the text before the tool-call marker streams; no marker: the whole turn is needed
        self.tool_marker = tool_marker if body.get("tools") else None
        self.incremental = self.streaming and (not body.get("tools") or self.tool_marker is not None)
        self.tokens: dict[int, list[int]] = {}
        self.sent: dict[int, str] = {}
        self.opened: set[int] = set()  # choices whose first delta (with the role) went out
        self.calls: dict[int, list[dict[str, str]]] = {}  # per choice, each streamed call's id, name, arguments
        self.stops: tuple[str, ...] = ()
        self.out: Any = None  # the StreamResponse once the first event went out
        self.broken = False  # the client went away: the call still completes (a session records it)
        self._wake = asyncio.Event()
        self._done = False
        self._pump: asyncio.Task | None = None

    def watch(self, index: int, stops: Sequence[str] = ()) -> Callable[[list[int]], None] | None:
        """The ``Request.on_token`` of choice ``index`` (None when the call does not stream incrementally)."""
        if not self.incremental:
            return None
        loop = asyncio.get_running_loop()
        self.tokens[index], self.sent[index], self.stops = [], "", tuple(stops)
        if self._pump is None:
            self._pump = loop.create_task(self._run_pump())

        def on_token(ids: list[int]) -> None:  # engine thread (hf) or this loop (vllm)
            loop.call_soon_threadsafe(self._arrived, index, ids)

        return on_token

    def _arrived(self, index: int, ids: list[int]) -> None:
        self.tokens[index].extend(ids)
        self._wake.set()

    def _head(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _delta(self, index: int, text: str) -> dict[str, Any]:
        if self.kind == "chat":
            return self._chat_delta(index, {"content": text})
        return {**self._head(), "choices": [{"index": index, "text": text, "finish_reason": None, "logprobs": None}]}

    def _chat_delta(self, index: int, delta: dict[str, Any]) -> dict[str, Any]:
        """A chat chunk of choice ``index``; its first one carries the role."""
        if index not in self.opened:
            self.opened.add(index)
            delta = {"role": "assistant", **delta}
        return {**self._head(), "choices": [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]}

    def _call_deltas(self, index: int, text: str) -> list[dict[str, Any]]:
        """The ``tool_calls`` deltas that ``text`` (the reply so far) adds to what was streamed of choice ``index``."""
        out, streamed = [], self.calls.setdefault(index, [])
        for k, call in enumerate(partial_calls(text, self.tool_marker or "")):
            if k == len(streamed):
                streamed.append({"id": ToolCall(call.name, {}).id, "name": call.name, "arguments": ""})
                entry = {"index": k, "id": streamed[k]["id"], "type": "function"}
                function = {"name": call.name, "arguments": ""}
                out.append(self._chat_delta(index, {"tool_calls": [{**entry, "function": function}]}))
            sent = streamed[k]["arguments"]
            if call.name == streamed[k]["name"] and len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                streamed[k]["arguments"] = call.arguments
                piece = {"index": k, "function": {"arguments": call.arguments[len(sent) :]}}
                out.append(self._chat_delta(index, {"tool_calls": [piece]}))
        return out

    async def _write(self, obj: dict[str, Any] | str) -> None:
        if self.broken:
            return
        try:
            if self.out is None:
                from aiohttp import web

                self.out = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await self.out.prepare(self.request)
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await self.out.write(f"data: {data}\n\n".encode())
        except (ConnectionError, RuntimeError) as e:  # the client closed the connection
            log.debug("endpoint: a streaming client went away (%s)", e)
            self.broken = True

    async def _run_pump(self) -> None:
        while not self._done:
            await self._wake.wait()
            self._wake.clear()
            for index, ids in self.tokens.items():
                whole = self.decode(ids[:-1])  # one token behind: the newest may end it
                text = self._sendable(whole)
                sent = self.sent[index]
                if len(text) > len(sent) and text.startswith(sent):
                    await self._write(self._delta(index, text[len(sent) :]))
                    self.sent[index] = text
                if self.tool_marker is not None and self.kind == "chat" and self.sent[index] == text:
                    for chunk in self._call_deltas(index, safe_prefix(whole, self.stops)):
                        await self._write(chunk)

    def _sendable(self, text: str) -> str:
        """What of a partial reply may be sent: short of a stop string and, with tools, of the tool-call marker,
        less trailing whitespace (nothing when the reply starts with whitespace: a reply with a call has its
        content stripped, one without keeps it, and which it is shows only at the end)."""
        if self.tool_marker is None:
            return safe_prefix(text, self.stops)
        if text[:1].isspace():
            return ""
        return safe_prefix(text, (*self.stops, self.tool_marker)).rstrip()

    async def _stop_pump(self) -> None:
        self._done = True
        self._wake.set()
        if self._pump is not None:
            await self._pump

    async def respond(self, make: Callable[[], Awaitable[dict[str, Any]]]) -> Any:
        """Run the call (``make`` returns the finished response object) and send its response."""
        from aiohttp import web

        try:
            resp = await make()
        except asyncio.CancelledError:
            if self._pump is not None:
                self._pump.cancel()
            raise
        except Exception as e:
            await self._stop_pump()
            if self.out is None:
                raise
            err = (
                e
                if isinstance(e, ApiError)
                else ApiError(500, f"{type(e).__name__}: {e}", "server_error", "server_error")
            )
            if not isinstance(e, ApiError):
                log.exception("endpoint: a streamed call failed after its first event")
            await self._write(err.body())
            await self._write("[DONE]")
            return self.out
        await self._stop_pump()
        if not self.streaming:
            return web.json_response(resp)
        opts = self.body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        for chunk in self._final_chunks(resp, include_usage):
            await self._write(chunk)
        await self._write("[DONE]")
        if not self.broken:
            await self.out.write_eof()
        return self.out

    def _final_chunks(self, resp: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
        whole = chat_chunks if self.kind == "chat" else completion_chunks
        streamed_any = any(self.sent.values()) or any(self.calls.values())
        if not streamed_any or resp["id"] != self.id:  # nothing sent yet (or a replay): all at once
            return whole(resp, include_usage)
        chunks = []
        for choice in resp["choices"]:
            index, sent = choice["index"], self.sent.get(choice["index"], "")
            final = (choice["message"].get("content") or "") if self.kind == "chat" else choice["text"]
            if not final.startswith(sent):
                log.warning("endpoint: streamed text %r is not a prefix of the final %r", sent[-40:], final[-40:])
            elif len(final) > len(sent):
                chunks.append(self._delta(index, final[len(sent) :]))
            if self.kind == "chat":
                chunks += self._final_calls(index, choice["message"])
            end = {"delta": {}} if self.kind == "chat" else {"text": ""}
            chunks.append(
                {
                    **self._head(),
                    "choices": [
                        {
                            "index": index,
                            **end,
                            "finish_reason": choice["finish_reason"],
                            "logprobs": choice.get("logprobs"),
                        }
                    ],
                }
            )
        if include_usage:
            chunks.append({**self._head(), "choices": [], "usage": resp["usage"]})
        return chunks

    def _final_calls(self, index: int, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``tool_calls`` deltas that finish choice ``index``: the rest of each streamed call's arguments, then
        the calls that did not stream, whole. ``message`` (the finished reply) takes the streamed ids and arguments
        text when the turn confirms them; when it does not, ``on_unconfirmed`` gets the reply as the client has it."""
        streamed, calls = self.calls.get(index, []), message.get("tool_calls") or []
        text = self.decode(self.tokens.get(index, []))
        cut = find_stop(text, self.stops)  # the reply ends at a stop string
        full = [c for c in partial_calls(text[:cut] if cut >= 0 else text, self.tool_marker or "") if c.closed]
        confirmed = len(calls) >= len(streamed) and all(
            k < len(full)
            and s["name"] == full[k].name == calls[k]["function"]["name"]
            and full[k].arguments.startswith(s["arguments"])
            and _loads(full[k].arguments) == _loads(calls[k]["function"]["arguments"])
            for k, s in enumerate(streamed)
        )
        out = []
        if confirmed:
            for k, s in enumerate(streamed):
                rest = full[k].arguments[len(s["arguments"]) :]
                if rest:
                    out.append(self._chat_delta(index, {"tool_calls": [{"index": k, "function": {"arguments": rest}}]}))
                calls[k] = {
                    **calls[k],
                    "id": s["id"],
                    "function": {**calls[k]["function"], "arguments": full[k].arguments},
                }
            if streamed:
                message["tool_calls"] = calls
            later = [{"index": k, **call} for k, call in enumerate(calls) if k >= len(streamed)]
            if later:
                out.append(self._chat_delta(index, {"tool_calls": later}))
            return out
        log.info(  # the model's own output, counted: not worth a warning per reply of a policy still learning
            "endpoint: the finished turn does not confirm the tool call(s) streamed so far (%s); the client keeps "
            "what it got",
            ", ".join(f"{s['name']}({s['arguments'][:40]}...)" for s in streamed),
        )
        if self.on_unconfirmed is not None:
            assembled = {
                "role": "assistant",
                "content": message.get("content"),
                "tool_calls": [
                    {"id": s["id"], "type": "function", "function": {"name": s["name"], "arguments": s["arguments"]}}
                    for s in streamed
                ],
            }
            self.on_unconfirmed(assembled)
        return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
