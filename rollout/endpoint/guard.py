"""What keeps the endpoint serving under abuse (issue 31, "the OpenAI endpoint"; docs/reliability.md).

- **Connections** (`Connections`): at most ``rollout.openai.max_connections`` open; a new one beyond
  the cap closes the longest-idle one (no call in progress), so idle sockets cannot lock agents out
  (nor run the process out of file descriptors). A connection with no call in progress for
  ``idle_timeout_s`` is closed: that is also the time a new connection has to send its first request
  (a slowloris that trickles headers holds nothing longer).
- **Bodies** (`read_json`): at most ``max_body_bytes`` (413 before the rest is read), received within
  ``body_timeout_s`` (408), valid JSON (400, also for nesting that would overflow the decoder),
  an object nested at most ``MAX_JSON_DEPTH`` deep (400).
- **Prompt size** (`check_text_size`): text that cannot fit the model's context is refused (400) before
  it is tokenized, so a huge message never holds the engine's loop in the tokenizer.

Everything runs on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from fleetrl.common.messages import nesting_depth
from fleetrl.rollout.endpoint.sessions import ApiError

MAX_JSON_DEPTH = 32  # an OpenAI request nests ~6 deep (tools' JSON schemas a few more)
CHARS_PER_TOKEN = 32  # no tokenizer packs more characters into one token on average
REAP_S = 1.0


class Connections:
    """The endpoint's open connections: the cap, the idle timeout, and which ones have a call in progress.

    ``factory(make)`` wraps aiohttp's protocol factory (a new connection), ``middleware`` marks calls in
    progress, ``reap()`` closes idle connections every second.
    """

    def __init__(self, cap: int, idle_s: float):
        self.cap, self.idle_s = cap, idle_s
        self.busy: dict[Any, int] = {}  # handler -> calls in progress
        self.since: dict[Any, float] = {}  # handler -> when it last became idle (or connected)
        self.born: dict[Any, float] = {}  # handler -> when it was accepted
        self.connected: set[Any] = set()  # handlers seen with a transport (so a None one later means closed)
        self.evicted = self.refused = 0

    def factory(self, make: Callable[[], Any]) -> Callable[[], Any]:
        def new_connection() -> Any:
            self._prune()
            if len(self.since) >= self.cap and not self._evict_one():
                self.refused += 1  # every connection has a call in progress: this one is closed at once
                return _Refused()
            handler = make()
            self.since[handler] = self.born[handler] = time.monotonic()
            return handler

        return new_connection

    def _evict_one(self) -> bool:
        idle = [(t, id(h), h) for h, t in self.since.items() if not self.busy.get(h)]
        if not idle:
            return False
        self._close(min(idle)[2])
        self.evicted += 1
        return True

    def _close(self, handler: Any) -> None:
        self._forget(handler)
        handler.force_close()

    def _prune(self) -> None:
        """Forget connections that closed (by the peer or by aiohttp). A handler's transport is None both before
        its connection is made (just accepted) and after it is lost: only the second counts as closed."""
        now = time.monotonic()
        for handler in list(self.since):
            if handler.transport is not None:
                self.connected.add(handler)
            elif handler in self.connected or now - self.born.get(handler, now) > 5.0:
                self._forget(handler)

    def _forget(self, handler: Any) -> None:
        for table in (self.since, self.busy, self.born):
            table.pop(handler, None)
        self.connected.discard(handler)

    def begin(self, handler: Any) -> None:
        self.busy[handler] = self.busy.get(handler, 0) + 1

    def end(self, handler: Any) -> None:
        left = self.busy.get(handler, 1) - 1
        if left > 0:
            self.busy[handler] = left
        else:
            self.busy.pop(handler, None)
        if handler in self.since:
            self.since[handler] = time.monotonic()

    @property
    def open(self) -> int:
        return len(self.since)

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            self._prune()
            now = time.monotonic()
            for handler, t in list(self.since.items()):
                if not self.busy.get(handler) and now - t > self.idle_s:
                    self._close(handler)


class _Refused(asyncio.Protocol):
    """A connection over the cap while every open one has a call in progress: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


async def read_json(request: Any, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object body, or ApiError: 413 (over ``client_max_size``), 408, 400."""
    from aiohttp import web

    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (rollout.openai.body_timeout_s)",
            "request_timeout",
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413,
            f"the request body is larger than {request.client_max_size} bytes (rollout.openai.max_body_bytes)",
            "request_too_large",
        ) from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    if nesting_depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    return body


def check_text_size(chars: int, context: int | None, param: str) -> None:
    """Refuse text that cannot fit ``context`` tokens at any tokenizer's density, before tokenizing it."""
    if context is not None and chars > CHARS_PER_TOKEN * context:
        raise ApiError(
            400,
            f"the {param} hold {chars} characters; the model's context is {context} tokens",
            "context_length_exceeded",
            param=param,
        )
