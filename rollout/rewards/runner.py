"""Runs reward calls under a time limit: sync calls on worker threads, coroutines on one event loop.

A call that runs past its limit is abandoned at the deadline by a watchdog thread: its future fails
with ``CallTimeout``, a coroutine is cancelled, and a worker thread stuck in a sync call is retired
(it exits once the call returns) and replaced, so ``workers`` threads keep serving. Python cannot
kill a thread, so a call that never returns keeps its thread until the process exits;
``abandoned`` counts those. Every thread is a daemon, so none of them blocks shutdown.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


class CallTimeout(TimeoutError):
    """A reward call ran past ``rollout.reward_timeout_s`` and was abandoned."""


@dataclass(eq=False)
class _Call:
    fn: Callable[[Any], Any]
    arg: Any
    timeout: float | None
    future: Future
    deadline: float = math.inf
    thread: threading.Thread | None = None  # the worker running a sync call
    cancel: Callable[[], Any] | None = None  # cancels a coroutine's task
    settled: bool = False  # the future has (or is about to have) its outcome


class CallRunner:
    """``workers`` daemon threads plus a lazily started event-loop thread, with per-call deadlines."""

    def __init__(self, workers: int, name: str = "reward"):
        self.name, self.workers = name, workers
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._running: set[_Call] = set()
        self._retired: set[threading.Thread] = set()
        self.abandoned_total = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        for _ in range(workers):
            self._spawn_worker()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def abandoned(self) -> int:
        """Worker threads still stuck in a call that timed out."""
        with self._cond:
            return len(self._retired)

    # ----------------------------------------------------------------------------- submitting

    def submit(self, fn: Callable[[Any], Any], arg: Any, timeout: float | None) -> Future:
        """Run ``fn(arg)`` on a worker thread; the clock starts when a worker picks it up."""
        call = _Call(fn, arg, timeout, Future())
        with self._cond:  # under the lock, so close() either sees this call in the queue or refuses it
            self._check_open()
            self._queue.put(call)
        return call.future

    def submit_async(self, fn: Callable[[Any], Awaitable[Any]], arg: Any, timeout: float | None) -> Future:
        """Run ``await fn(arg)`` on the event loop; the clock starts now."""
        self._check_open()
        call = _Call(fn, arg, timeout, Future())
        call.future.set_running_or_notify_cancel()
        try:
            coro = fn(arg)
        except Exception as e:  # binding errors surface when the coroutine is created
            self._settle(call, None, e)
            return call.future
        with self._cond:
            self._begin(call, None)
        task = asyncio.run_coroutine_threadsafe(coro, self._event_loop())
        with self._cond:
            call.cancel = task.cancel
            expired = call.settled
        if expired:  # the watchdog fired before the task existed
            task.cancel()
        task.add_done_callback(lambda t: self._settle_task(call, t))
        return call.future

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} runner is closed")

    # ------------------------------------------------------------------------------- internals

    def _spawn_worker(self) -> None:
        threading.Thread(target=self._work, name=f"{self.name}-worker", daemon=True).start()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._cond:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=self._loop.run_forever, name=f"{self.name}-loop", daemon=True
                )
                self._loop_thread.start()
            return self._loop

    def _begin(self, call: _Call, thread: threading.Thread | None) -> None:
        """Start the call's clock (caller holds the lock)."""
        call.thread = thread
        if call.timeout is not None:
            call.deadline = time.monotonic() + call.timeout
            self._cond.notify_all()
        self._running.add(call)

    def _settle(self, call: _Call, value: Any, exc: BaseException | None) -> None:
        """Give the call its outcome unless the watchdog already timed it out."""
        with self._cond:
            if call.settled:
                return
            call.settled = True
            self._running.discard(call)
        if exc is None:
            call.future.set_result(value)
        else:
            call.future.set_exception(exc)

    def _settle_task(self, call: _Call, task: Future) -> None:
        if task.cancelled():
            self._settle(call, None, CallTimeout("cancelled"))
        else:
            exc = task.exception()
            self._settle(call, None if exc else task.result(), exc)

    def _work(self) -> None:
        me = threading.current_thread()
        while (call := self._queue.get()) is not None:
            if not call.future.set_running_or_notify_cancel():
                continue
            with self._cond:
                self._begin(call, me)
            try:
                value, exc = call.fn(call.arg), None
            except BaseException as e:  # SystemExit from user code must not kill the worker silently
                value, exc = None, e
            self._settle(call, value, exc)
            del call, value, exc
            with self._cond:
                if me in self._retired:  # timed out earlier; a replacement took this thread's place
                    self._retired.discard(me)
                    return

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [c for c in self._running if c.deadline <= now]
                for c in expired:
                    c.settled = True
                    self._running.discard(c)
                    if c.thread is not None:
                        self._retired.add(c.thread)
                        self.abandoned_total += 1
                        self._spawn_worker()
                if not expired:
                    nxt = min((c.deadline for c in self._running), default=math.inf)
                    self._cond.wait(None if nxt == math.inf else nxt - now)
            for c in expired:
                if c.cancel is not None:
                    c.cancel()
                c.future.set_exception(CallTimeout(f"timed out after {c.timeout:g} s"))

    def close(self) -> None:
        """Cancel queued calls, fail running ones, stop the threads (stuck ones are left to exit)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
            self._running.clear()
            for c in running:
                c.settled = True
            self._cond.notify_all()
        while True:
            try:
                call = self._queue.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call.future.cancel()
        for _ in range(self.workers):
            self._queue.put(None)
        for c in running:
            if c.cancel is not None:
                c.cancel()
            c.future.set_exception(RuntimeError(f"{self.name} runner closed"))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=1.0)
            if not self._loop_thread.is_alive():
                self._loop.close()
