"""A small local verifiers (0.4, ``verifiers.v1``) taskset for the verifiers lane: sums of two numbers, built in
code (no hub download). Its rubric: ``exact`` (the reply is the sum, weight 1) and ``digits`` (the share of the
reply's characters that are digits, weight 0.5: partial credit, so a group from an untrained model still has
signal); a metric ``reply_chars``. ``args``: ``n`` tasks, ``seed``, ``high`` (largest operand)."""

import random

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def digits(self, trace: vf.Trace) -> float:
        return digit_share(trace.last_reply)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ArithConfig(vf.TasksetConfig):
    n: int = 64
    seed: int = 0
    high: int = 9


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.n):
            a, b = rng.randint(0, self.config.high), rng.randint(0, self.config.high)
            yield ArithTask(ArithData(id=f"sum-{i}", prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


def digit_share(text: str) -> float:
    """The share of ``text``'s characters that are digits (0 for an empty reply)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


__all__ = ["ArithTaskset"]
