"""One multi-turn episode, token-in/token-out (the loop every multi-turn environment shares).

    reset(row) -> messages -> prompt tokens
    per turn: generate on the whole context so far -> the sampled tokens (mask 1) -> step(message)
              -> done? else the turn's tail and the observations as tokens (mask 0) -> next turn

The context handed to the engine is the token list itself, so no earlier turn is ever decoded and
tokenized again. Budgets: ``max_turns`` assistant turns, ``max_total_tokens`` response tokens in
all, and the model's context length; whichever ends the episode is recorded in
``Episode.truncated`` (finish_reason ``length``). ``max_tokens_per_turn`` is like ``max_tokens`` of one
API call: a turn cut there ends that turn (counted, ``env/turns_cut_total``), and the environment
answers it as it stands. An ``EnvFailure`` from the
environment (or a template mismatch) ends it with ``failure`` set: the sample is dropped, not scored.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleetrl.common.chat.codec import ChatCodec
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.envs.base import EnvFailure, EnvSession, Episode, Message, StepResult, check_messages

log = logging.getLogger("fleetrl.rollout.envs")


@dataclass(frozen=True)
class Budget:
    max_turns: int
    per_turn: int
    total: int
    context: int | None  # the model's context length (prompt + response), None = unknown

    @classmethod
    def from_config(cls, cfg: Any, engine: Any) -> Budget:
        env = cfg.rollout.env
        return cls(
            env.max_turns,
            env.max_tokens_per_turn or cfg.rollout.max_new_tokens,
            env.max_total_tokens,
            getattr(engine, "max_positions", None),
        )

    def room(self, prompt_len: int, response_len: int) -> tuple[int, str]:
        """Tokens the next turn may sample, and the budget that limits it most."""
        options = [(self.per_turn, "turn_tokens"), (self.total - response_len, "total_tokens")]
        if self.context is not None:
            options.append((self.context - 1 - prompt_len - response_len, "context"))
        return min(options)


class EpisodeBuilder:
    """The growing token sequence of one episode and what is known about it."""

    def __init__(self, prompt_ids: list[int], messages: list[Message]):
        self.ep = Episode(
            token_ids=[],
            logprobs=[],
            finish_reason="stop",
            text="",
            prompt_ids=list(prompt_ids),
            messages=list(messages),
            counts=Counter(),
        )
        self.rewards: list[float] = []

    def context(self) -> list[int]:
        return self.ep.prompt_ids + self.ep.token_ids

    def sampled(self, gen: Generation, version: int) -> None:
        ep = self.ep
        ep.token_ids += gen.token_ids
        ep.logprobs += gen.logprobs
        ep.versions += gen.versions if len(gen.versions) == len(gen.token_ids) else [version] * len(gen.token_ids)
        ep.loss_mask += [1] * len(gen.token_ids)
        ep.text = gen.text
        ep.turns += 1
        ep.messages.append({"role": "assistant", "content": gen.text})

    def appended(self, ids: list[int], version: int) -> None:
        ep = self.ep
        ep.token_ids += ids
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [version] * len(ids)
        ep.loss_mask += [0] * len(ids)

    def step(self, result: StepResult) -> None:
        if result.reward is not None:
            self.rewards.append(result.reward)
        for name, value in result.parts.items():
            self.ep.reward_parts[name] = self.ep.reward_parts.get(name, 0.0) + value
        for key, value in result.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.ep.counts[f"info/{key}"] += value

    def finish(self, truncated: str = "", failure: EnvFailure | None = None) -> Episode:
        ep = self.ep
        ep.reward = sum(self.rewards) if self.rewards else None
        if truncated:
            ep.truncated, ep.finish_reason = truncated, "length"
        if failure is not None:
            ep.failure, ep.error = failure.kind, str(failure)[:500]
        return ep


async def run_episode(
    engine: Any,
    session: EnvSession,
    codec: ChatCodec,
    row: dict[str, Any],
    params: SamplingParams,
    budget: Budget,
    request_id: str,
    trace: dict[str, str] | None = None,
) -> Episode:
    """One episode of ``session`` on ``engine`` (see the module docstring); never raises EnvFailure."""
    builder: EpisodeBuilder | None = None
    try:
        messages = check_messages(await session.reset(row), "reset")
        builder = EpisodeBuilder(codec.initial(messages), messages)
        return await _turns(engine, session, codec, builder, params, budget, request_id, trace)
    except EnvFailure as e:
        log.debug("episode %s failed: %s", request_id, e)
        return (builder or EpisodeBuilder([], [])).finish(failure=e)
    finally:
        try:
            await session.close()
        except Exception as e:  # noqa: BLE001 - a failing close loses nothing that was sampled
            log.warning("closing the environment of episode %s failed: %s", request_id, e)


async def _turns(
    engine: Any,
    session: EnvSession,
    codec: ChatCodec,
    b: EpisodeBuilder,
    params: SamplingParams,
    budget: Budget,
    request_id: str,
    trace: dict[str, str] | None,
) -> Episode:
    for turn in range(budget.max_turns):
        room, limit = budget.room(len(b.ep.prompt_ids), len(b.ep.token_ids))
        if room < 1:
            return b.finish(truncated=limit)
        turn_params = dataclasses.replace(params, max_new_tokens=room)
        gen = await engine.generate(Request(b.context(), turn_params, f"{request_id}/turn-{turn}", trace))
        b.sampled(gen, engine.version)
        if gen.finish_reason == "length":
            if limit != "turn_tokens":  # the episode's own budget (total tokens, context) is spent: it ends here
                return b.finish(truncated=limit)
            b.ep.counts["turns_cut"] += 1  # like max_tokens of one API call: the turn ends, the episode goes on
        result = await session.step(dict(b.ep.messages[-1]))
        b.step(result)
        b.ep.counts.update(result.info.get("_counts", {}))
        if result.done:
            return b.finish()
        appended = codec.turn_tail(gen) + codec.observation(b.ep.messages, result.observations)
        if len(b.ep.token_ids) + len(appended) >= budget.total:  # no room left to answer the observations
            return b.finish(truncated="total_tokens")
        b.appended(appended, engine.version)
        b.ep.messages += result.observations
    return b.finish(truncated="turns")
