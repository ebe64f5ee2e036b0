"""The environment contract: what an episode is, what a step returns, how a sample fails.

The server side (``Environment``): built once per rollout server from ``rollout.env``;
``task(prompt)`` runs on the server's thread when a prompt is admitted, and ``episode(...)`` is a
coroutine on the engine's event loop that produces one sample of the prompt's group::

    task = env.task(prompt)                                   # once per prompt
    sample = await env.episode(engine, task, params, request_id, trace)   # group_size times

A single-turn sample is a plain ``Generation``; a multi-turn one is an ``Episode``: the response
tokens of every turn back to back (assistant tokens exactly as sampled, with their behaviour
log-probs and loss mask 1; observation and tool tokens appended as tokens, mask 0), the reward the
environment gave (None = score it with ``rollout.rewards``), and ``failure`` when the environment
failed (the sample is then dropped, never scored).

The per-episode side (``EnvSession``, what `tool`, `user` and `http` implement; the user contract
of docs/environments.md maps onto it one to one)::

    messages = await session.reset(row)        # row: {prompt, answer, metadata, prompt_id}
    result = await session.step(message)       # message: {"role": "assistant", "content": text}
    await session.close()                      # always called, also after a failure
"""

from __future__ import annotations

import abc
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetrl.common import messages as m

# re-exported: the environments raise them (they live beside the chat codec, which raises TemplateMismatch)
from fleetrl.common.chat.errors import EnvFailure as EnvFailure
from fleetrl.common.chat.errors import Message as Message
from fleetrl.common.chat.errors import TemplateMismatch as TemplateMismatch
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation

if TYPE_CHECKING:
    from fleetrl.common.config.schema import JobConfig


class EnvTimeout(EnvFailure):
    """A reset, step or tool call ran past its time limit (``rollout.env.step_timeout_s`` ...)."""

    kind = "timeouts"


@dataclass
class StepResult:
    """What one step returns: the messages appended after the assistant's turn (``role`` user, tool,
    system...), the step's reward (None = none; an episode's reward is the sum of its steps' rewards,
    or None when every step gave None), whether the episode is over, free-form info (numbers in
    it are summed into ``env/info/<key>`` metrics) and, optionally, the reward's named parts (recorded as
    the sample's reward parts instead of one ``env`` part)."""

    observations: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)  # the reward's named parts (a rubric's), summed per name

    @classmethod
    def coerce(cls, value: Any, where: str) -> StepResult:
        """A StepResult from what a user step returned: a StepResult, a 4-tuple, or a dict with those keys."""
        if isinstance(value, StepResult):
            out = value
        elif isinstance(value, (tuple, list)) and len(value) == 4:
            out = cls(list(value[0] or []), value[1], bool(value[2]), dict(value[3] or {}))
        elif isinstance(value, dict):
            out = cls(
                list(value.get("observations") or []),
                value.get("reward"),
                bool(value.get("done", False)),
                dict(value.get("info") or {}),
            )
        else:
            raise EnvFailure(f"{where} returned {type(value).__name__}; return (observations, reward, done, info)")
        out.observations = check_messages(out.observations, f"{where} observations")
        if out.reward is not None:
            if (
                isinstance(out.reward, bool)
                or not isinstance(out.reward, (int, float))
                or not math.isfinite(out.reward)
            ):
                raise EnvFailure(f"{where} returned reward {out.reward!r}; return a finite number or None")
            out.reward = float(out.reward)
        return out


def check_messages(messages: Any, where: str) -> list[Message]:
    """Chat messages as the contract has them: a list of dicts with a string ``role``."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not all(
        isinstance(x, dict) and isinstance(x.get("role"), str) for x in messages
    ):
        raise EnvFailure(
            f"{where}: expected a list of messages like {{'role': 'user', 'content': '...'}}, "
            f"got {str(messages)[:120]!r}"
        )
    return messages


@dataclass
class Episode(Generation):
    """One multi-turn sample (see the module docstring). ``token_ids``, ``logprobs``, ``versions`` and
    ``loss_mask`` cover every response token, sampled (mask 1) and appended (mask 0, log-prob 0);
    ``text`` is the last assistant turn's text (what reward functions score)."""

    prompt_ids: list[int] = field(default_factory=list)  # the context before the first response token
    loss_mask: list[int] = field(default_factory=list)
    reward: float | None = None  # the environment's reward; None = score with rollout.rewards
    reward_parts: dict[str, float] = field(default_factory=dict)  # its named parts (a rubric's); {} = {"env": reward}
    failure: str = ""  # EnvFailure.kind when the environment failed (the sample is dropped)
    error: str = ""
    truncated: str = ""  # the budget that ended the episode: turns, turn_tokens, total_tokens, context
    turns: int = 0
    messages: list[Message] = field(default_factory=list)  # the conversation, for logs and rewards
    counts: Counter = field(default_factory=Counter)  # tool_calls, malformed_tool_calls, tool_errors, info/...

    @property
    def failed(self) -> bool:
        return bool(self.failure)


@dataclass
class Task:
    """One admitted prompt as the environment sees it: the prompt and, for single-turn, its tokens."""

    prompt: m.Prompt
    prompt_ids: list[int] = field(default_factory=list)

    @property
    def row(self) -> dict[str, Any]:
        """What ``reset`` receives: the prompt (text or messages), the answer, the row's other columns."""
        p = self.prompt
        return {"prompt": p.prompt, "answer": p.answer, "metadata": dict(p.metadata), "prompt_id": p.prompt_id}


class EnvStats:
    """Counters of every episode of one server (episodes end on the engine's thread, metrics are read
    on the finisher's): ``*_total`` since start, means over the episodes since the last ``take``."""

    TOTALS = (
        "episodes",
        "errors",
        "timeouts",
        "template_errors",
        "malformed_tool_calls",
        "tool_calls",
        "tool_errors",
        "turns_cut",
        "truncated",
        "samples_dropped",
        "groups_dropped",
        "groups_partial",
        "groups_per_sample_prompts",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: Counter[str] = Counter()
        self.window: Counter[str] = Counter()

    def add(self, **counts: float) -> None:
        with self._lock:
            self.totals.update(counts)

    def episode(self, ep: Episode) -> None:
        with self._lock:
            t, w = self.totals, self.window
            t["episodes"] += 1
            w["episodes"] += 1
            w["turns"] += ep.turns
            w["tokens"] += len(ep.token_ids)
            if ep.failure:
                t[ep.failure] += 1
            if ep.truncated:
                t["truncated"] += 1
                t[f"truncated/{ep.truncated}"] += 1
            for key, value in ep.counts.items():
                t[key] += value
                w[key] += value

    def take(self) -> dict[str, float]:
        """The metrics: totals, and per-episode means of the window (then reset)."""
        with self._lock:
            t, w = self.totals, self.window
            out = {f"env/{k}_total": float(t[k]) for k in self.TOTALS}
            out.update({f"env/{k}_total": float(v) for k, v in t.items() if "/" in k})
            n = w["episodes"]
            if n:
                out["env/turns_mean"] = w["turns"] / n
                out["env/tokens_mean"] = w["tokens"] / n
                calls = w["tool_calls"] + w["malformed_tool_calls"]
                if calls:
                    out["env/tool_calls_per_episode"] = calls / n
                    out["env/tool_calls_wellformed_frac"] = w["tool_calls"] / calls
            self.window = Counter()
        return out


class Environment(abc.ABC):
    """What the rollout server asks for samples (see the module docstring); one per server."""

    multi_turn = True

    def __init__(self, cfg: JobConfig, tokenizer: Any):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.env_cfg = cfg.rollout.env
        self.stats = EnvStats()

    def task(self, prompt: m.Prompt) -> Task:
        """Called on the server's thread once per admitted prompt (single-turn encodes it here)."""
        return Task(prompt)

    @abc.abstractmethod
    async def episode(
        self, engine: Any, task: Task, params: SamplingParams, request_id: str, trace: dict[str, str] | None
    ) -> Generation:
        """One sample of ``task``'s group: a ``Generation`` (single-turn) or an ``Episode``."""

    def check(self) -> None:
        """Start-up checks (the chat template); raise ConfigError naming what to change."""

    def metrics(self) -> dict[str, float]:
        return self.stats.take()

    def settled(self, group: str, pushed: bool, reason: str) -> None:
        """The fate of the group whose request ids start with ``group + "/"``: pushed to the broker, or dropped
        by the group rule (``reason``). Sessions report it to their agents; other environments ignore it."""

    def begin_stop(self) -> None:
        """The server admits no more prompts and finishes the samples in flight (sessions: the waiting ones fail)."""

    def close(self) -> None:
        """Release what the environment holds (HTTP sessions, thread pools)."""


class EnvSession(abc.ABC):
    """One episode's environment (see the module docstring)."""

    @abc.abstractmethod
    async def reset(self, row: dict[str, Any]) -> list[Message]: ...

    @abc.abstractmethod
    async def step(self, message: Message) -> StepResult: ...

    async def close(self) -> None:
        return None

    def example_messages(self) -> list[Message] | None:
        """A conversation shaped like this environment's, for the start-up template check (None = a generic one)."""
        return None
