"""A tiny local verifiers (0.4, verifiers.v1) taskset for the fleetrl endpoint trial: products of two numbers."""

import verifiers.v1 as vf


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        pairs = [(12, 34), (7, 8), (21, 3), (45, 2)]
        return [
            CalcTask(CalcData(idx=i, prompt=f"{a}*{b}=", answer=str(a * b)), self.config.task)
            for i, (a, b) in enumerate(pairs)
        ]


__all__ = ["CalcTaskset"]
