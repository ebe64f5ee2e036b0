"""`user` environments the tests load by module path (tests.rollout.envs.envs_for_tests:Name)."""

from __future__ import annotations

import asyncio
import time


class Chatter:
    """Answers every assistant turn with an observation (alternating user and tool messages); done
    after ``turns`` steps. Reward: the number of turns whose text had a digit, on the last step."""

    example_messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "go on 0"},
        {"role": "assistant", "content": "b"},
        {"role": "tool", "content": "tool says 1"},
        {"role": "assistant", "content": "c"},
    ]

    def __init__(self, turns: int = 9, reward: bool = True):
        self.turns, self.give_reward, self.seen = turns, reward, []

    def reset(self, row):
        return [{"role": "user", "content": f"chat about {row['prompt']}"}]

    def step(self, message):
        self.seen.append(message["content"])
        n = len(self.seen)
        done = n >= self.turns
        reward = float(sum(any(c.isdigit() for c in t) for t in self.seen)) if done and self.give_reward else None
        role = "user" if n % 2 else "tool"
        return (
            [{"role": role, "content": f"{'go on' if role == 'user' else 'tool says'} {n}"}],
            reward,
            done,
            {"steps": 1},
        )


class AsyncChatter(Chatter):
    async def reset(self, row):
        await asyncio.sleep(0)
        return super().reset(row)

    async def step(self, message):
        await asyncio.sleep(0)
        return super().step(message)


class Flaky(Chatter):
    """Fails as ``mode`` says on step ``at`` of episodes whose prompt id is odd (so some samples survive)."""

    calls = 0

    def __init__(self, mode: str = "raise", at: int = 1, every: int = 2):
        super().__init__(turns=3)
        self.mode, self.at, self.every = mode, at, every
        Flaky.calls += 1
        self.fail = Flaky.calls % every == 0

    def step(self, message):
        if self.fail and len(self.seen) + 1 == self.at:
            if self.mode == "raise":
                raise RuntimeError("the environment broke")
            if self.mode == "sleep":
                time.sleep(2.0)
            if self.mode == "bad":
                return "not a step result"
            if self.mode == "nan":
                return [], float("nan"), True, {}
        return super().step(message)


class NoClass:
    pass


class PartsChatter(Chatter):
    """Like Chatter, but every step scores itself in named parts (``digit``: its text has a digit; ``turn``: 1),
    reward ``digit + 0.1 * turn``, as a rubric would."""

    def step(self, message):
        from fleetrl.rollout.envs.base import StepResult

        observations, _, done, info = super().step(message)
        parts = {"digit": float(any(c.isdigit() for c in message["content"])), "turn": 1.0}
        return StepResult(observations, parts["digit"] + 0.1 * parts["turn"], done, info, parts=parts)
