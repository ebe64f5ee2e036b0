"""``EngineLoop``: the asyncio event loop an engine runs on, in a thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EngineLoop:
    """The asyncio event loop an engine runs on, in a thread of its own.

    Synchronous code (the rollout server's main loop, `fleetrl eval`, tests) hands coroutines to it
    with `submit` (a `concurrent.futures.Future`) or `call` (blocks for the result); coroutines
    that already run on it (a multi-turn episode) simply ``await engine.generate(request)``.
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
