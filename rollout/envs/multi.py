"""What `tool`, `user` and `http` share: a session per episode, run by ``episode.run_episode``, and the
start-up check that the chat template is prefix-stable for the environment's messages."""

from __future__ import annotations

import abc
import asyncio
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from fleetrl.common.chat.codec import GENERIC_EXAMPLE, ChatCodec, check_prefix_stable
from fleetrl.common.config import ConfigError
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.envs.base import EnvFailure, Environment, EnvSession, EnvTimeout, Episode, Message, Task
from fleetrl.rollout.envs.episode import Budget, run_episode

log = logging.getLogger("fleetrl.rollout.envs")


class MultiTurnEnvironment(Environment):
    """An environment whose episodes are sessions (``session(task)``) run turn by turn, token-in/token-out."""

    def __init__(self, cfg: Any, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self.codec = ChatCodec(tokenizer, self.tool_schemas())

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is given (None = none)."""
        return None

    @abc.abstractmethod
    def session(self, task: Task) -> EnvSession:
        """A fresh environment for one episode of ``task``."""

    async def episode(
        self, engine: Any, task: Task, params: SamplingParams, request_id: str, trace: dict[str, str] | None
    ) -> Episode:
        ep = await run_episode(
            engine,
            self.session(task),
            self.codec,
            task.row,
            params,
            Budget.from_config(self.cfg, engine),
            request_id,
            trace,
        )
        self.stats.episode(ep)
        if ep.failure:
            log.warning(
                "episode %s: the environment failed (%s: %s); the sample is dropped, not scored",
                request_id,
                ep.failure,
                ep.error,
            )
        return ep

    def example_messages(self) -> list[Message]:
        return GENERIC_EXAMPLE

    def check(self) -> None:
        if not self.env_cfg.check_template:
            return
        try:
            check_prefix_stable(self.codec, self.example_messages())
        except EnvFailure as e:
            raise ConfigError(
                f"rollout.env ({self.env_cfg.type}): {e} (or set rollout.env.check_template=false to start anyway)"
            ) from None


async def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    """``fn(*args)``: awaited when it is a coroutine function, else in a worker thread; at most ``timeout_s``.

    A timeout raises ``EnvTimeout`` (a sync call's thread is left to finish on its own); any other
    exception raises ``EnvFailure`` naming ``what``.
    """
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout_s)
        return await asyncio.wait_for(asyncio.to_thread(functools.partial(fn, *args)), timeout_s)
    except asyncio.TimeoutError:
        raise EnvTimeout(f"{what} took longer than {timeout_s:g} s") from None
    except EnvFailure:
        raise
    except Exception as e:  # noqa: BLE001 - the environment's own error: the sample fails, the server goes on
        raise EnvFailure(f"{what} raised {type(e).__name__}: {e}") from e
