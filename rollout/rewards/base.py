"""What a reward sees and returns, the reward registry, and the base classes of every reward.

A reward is built from its config entry as ``REWARDS[name](**args)`` and called on a batch:
``reward(batch: list[RewardInput]) -> list[float | None]``, one score per sample, None for a sample it
cannot score (counted and skipped, never scored 0). Rewards that score one sample at a time
(``per_sample``) derive from ``SampleReward`` and implement ``score`` (or ``ascore`` for coroutines);
the ``RewardScorer`` then runs each sample as its own call under ``rollout.reward_timeout_s``, so one
slow or broken sample fails alone. Other rewards (the ``model`` reward, batched ``python`` functions)
see the whole batch at once.

Arguments are typed: each reward declares an ``Args`` struct (msgspec, unknown keys rejected) and
``Reward.__init__`` converts the config's ``args`` into it, so a typo or a wrong type fails when
the server starts, not on the first sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgspec

from fleetrl.common.config import ConfigError
from fleetrl.common.plugins.registry import Registry

# Config entries are found by the scorer with their index (rollout.rewards[i].name), so the registry
# carries no config_key of its own.
REWARDS: Registry[Callable[..., Any]] = Registry("reward function")

R = TypeVar("R", bound=type)


def register_reward(name: str, *aliases: str) -> Callable[[R], R]:
    """Class decorator: register a ``Reward`` subclass under ``name`` (and aliases); sets ``cls.name``."""

    def wrap(cls: R) -> R:
        cls.name = name
        return REWARDS.register(name, *aliases)(cls)

    return wrap


@dataclass(frozen=True)
class RewardInput:
    """One sampled response and what the data set knows about its prompt."""

    prompt: str | list[dict[str, str]]  # raw prompt text or chat messages
    response: str  # decoded response text (special tokens and stop strings removed)
    answer: str | None  # ground truth from the data set (None if absent)
    metadata: dict[str, Any]  # the data row's other columns
    finish_reason: str = "stop"  # "stop" | "length"
    num_tokens: int = 0  # response length in tokens


@dataclass
class RewardResult:
    """The reward of one sample: the weighted sum of its parts, and whether any part failed."""

    reward: float  # weighted sum over the parts that scored it (failed parts add 0.0)
    parts: dict[str, float]  # per reward label, unweighted (0.0 for a failed part; absent: no score), for logging
    failed: bool  # any part failed (raised / timed out / returned a non-finite or non-number)
    error: str = ""  # short reason of the first failure
    scored: bool = True  # False: no part scored it (all returned None); the sample is not trained on
    failed_parts: tuple[str, ...] = ()  # the labels of the parts that failed (their 0.0 in parts is no score)


class RewardArgsError(ConfigError):
    """Bad ``args`` of a reward. The scorer prefixes the config key, ``rollout.rewards[i].args``."""


class RewardArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every reward's typed arguments; unknown keys are rejected."""


def convert_args(reward_name: str, args_type: type[RewardArgs], args: dict[str, Any]) -> Any:
    """Decode ``args`` into ``args_type``; errors name the bad key and list the valid ones."""
    try:
        return msgspec.convert(args, args_type)
    except msgspec.ValidationError as e:
        valid = ", ".join(f.name for f in msgspec.structs.fields(args_type)) or "no arguments"
        reason = str(e).replace("`$.", "`")
        raise RewardArgsError(f"{reason}; reward {reward_name!r} takes: {valid} (see docs/rewards.md)") from None


class Reward:
    """A batch reward: ``reward(batch) -> list[float]``, one score per sample, in order.

    Subclasses declare ``Args`` (a ``RewardArgs`` struct), register with ``@register_reward(name)``,
    and read their validated arguments from ``self.args``. ``close()`` frees what they hold.
    """

    name: ClassVar[str] = "reward"
    Args: ClassVar[type[RewardArgs]] = RewardArgs
    per_sample: bool = False  # the scorer calls score()/ascore() per sample, else the reward on the whole batch
    time_limited: ClassVar[bool] = (
        False  # a batch call runs under rollout.reward_timeout_s (per-sample calls always do)
    )

    def __init__(self, **args: Any):
        self.args = convert_args(self.name, self.Args, args)
        self.label = self.name  # its name in metrics (`rollout.rewards[i].label` overrides it)

    def __call__(self, batch: list[RewardInput]) -> list[float]:
        raise NotImplementedError

    @classmethod
    def check(cls, **args: Any) -> None:
        """What `fleetrl config validate` checks of this reward without building it (a model reward would
        load its model): the arguments; subclasses add cheap checks. Raises RewardArgsError."""
        convert_args(cls.name, cls.Args, args)

    def close(self) -> None:
        """Release resources (models, clients); the default holds none."""


class SampleReward(Reward):
    """A reward computed one sample at a time: implement ``score`` (or ``ascore`` and set ``is_async``).

    The scorer calls ``score`` / ``ascore`` once per sample under the time limit; calling the
    reward on a batch directly scores the samples in order without one.
    """

    is_async: bool = False
    per_sample: bool = True

    def score(self, x: RewardInput) -> float:
        if self.is_async:
            return asyncio.run(self.ascore(x))
        raise NotImplementedError

    async def ascore(self, x: RewardInput) -> float:
        raise NotImplementedError

    def __call__(self, batch: list[RewardInput]) -> list[float | None]:
        return [None if (v := self.score(x)) is None else float(v) for x in batch]


def require_answer(x: RewardInput, reward_name: str) -> str:
    """The sample's ground truth; a sample without one fails (it cannot be scored)."""
    if x.answer is None:
        raise ValueError(f"the {reward_name} reward needs a ground-truth answer; check data.answer_key")
    return x.answer
