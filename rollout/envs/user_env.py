"""``user``: an environment class of your own, by module path (``rollout.env.user.cls``).

The contract (docs/environments.md), for ``cls: mypkg.envs:GuessNumber``::

    class GuessNumber:
        def __init__(self, **args): ...            # rollout.env.user.args; ONE INSTANCE PER EPISODE
        def reset(self, row) -> messages:          # row = {"prompt", "answer", "metadata", "prompt_id"}
            ...                                    # messages: [{"role": ..., "content": ...}, ...] or a str
        def step(self, message) -> (observations, reward, done, info):
            ...                                    # message = {"role": "assistant", "content": text}
        def close(self): ...                       # optional, always called once the episode ends
        example_messages = [...]                   # optional: a conversation for the start-up template check

- ``observations``: messages appended after the assistant's turn (``user``, ``tool``...), ignored
  when ``done``; ``reward``: a finite number or None; the episode's reward is the sum of its steps'
  rewards, or, when every step gave None, ``rollout.rewards`` on the last assistant text;
  ``info``: a dict; its numbers are summed into ``env/info/<key>_total``. A StepResult or a dict
  with those four keys is accepted too.
- Methods may be ``async def`` (awaited on the engine's event loop: never block in them) or plain
  (run in a worker thread). Each reset and step has ``rollout.env.step_timeout_s``.
- Anything raised, a timeout, or a return value outside the contract fails the sample: it is
  dropped and counted (``env/errors_total``, ``env/timeouts_total``), never scored.
"""

from __future__ import annotations

import inspect
from typing import Any

from fleetrl.common.config import ConfigError
from fleetrl.rollout.envs.base import EnvSession, Message, StepResult, Task, check_messages
from fleetrl.rollout.envs.multi import MultiTurnEnvironment, call_with_timeout
from fleetrl.rollout.rewards.python import load_function


def load_env_class(opts: Any) -> type:
    """rollout.env.user.cls imported and checked (a class with reset and step, constructible with
    rollout.env.user.args), as `fleetrl config validate` and the environment's start both check it."""
    try:
        cls = load_function(opts.cls)
    except ValueError as e:
        raise ConfigError(f"rollout.env.user.cls: {e}") from None
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if not inspect.isclass(cls) or missing:
        raise ConfigError(
            f"rollout.env.user.cls: {opts.cls!r} must be a class with reset(row) and step(message) "
            f"(missing: {', '.join(missing) or 'it is not a class'}); see docs/environments.md"
        )
    try:
        inspect.signature(cls).bind(**opts.args)
    except TypeError as e:
        raise ConfigError(f"rollout.env.user.args: {e}; {opts.cls} takes {inspect.signature(cls)}") from None
    return cls


def user_env_problems(cfg: Any) -> list[str]:
    """`config validate`'s check of rollout.env.user (nothing for other environment types)."""
    if cfg.rollout.env.type != "user":
        return []
    try:
        load_env_class(cfg.rollout.env.user)
    except ConfigError as e:
        return [str(e)]
    return []


class UserEnv(MultiTurnEnvironment):
    def __init__(self, cfg: Any, tokenizer: Any):
        opts = cfg.rollout.env.user
        self.cls = load_env_class(opts)
        self.args, self.timeout_s = dict(opts.args), cfg.rollout.env.step_timeout_s
        super().__init__(cfg, tokenizer)

    def session(self, task: Task) -> EnvSession:
        return UserSession(self.cls, self.args, self.timeout_s)

    def example_messages(self) -> list[Message]:
        example = getattr(self.cls, "example_messages", None)
        example = example() if callable(example) else example
        return (
            check_messages(example, f"{self.cls.__name__}.example_messages") if example else super().example_messages()
        )


class UserSession(EnvSession):
    """One instance of the user's class, its calls under the time limit."""

    def __init__(self, cls: type, args: dict[str, Any], timeout_s: float):
        self.cls, self.args, self.timeout_s = cls, args, timeout_s
        self.env: Any = None
        self.name = cls.__name__

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.env = await call_with_timeout(
            lambda: self.cls(**self.args), timeout_s=self.timeout_s, what=f"{self.name}(...)"
        )
        return await call_with_timeout(self.env.reset, row, timeout_s=self.timeout_s, what=f"{self.name}.reset")

    async def step(self, message: Message) -> StepResult:
        out = await call_with_timeout(self.env.step, message, timeout_s=self.timeout_s, what=f"{self.name}.step")
        return StepResult.coerce(out, f"{self.name}.step")

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            await call_with_timeout(close, timeout_s=self.timeout_s, what=f"{self.name}.close")
