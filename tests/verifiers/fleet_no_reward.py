"""A verifiers taskset whose tasks declare a metric but no reward: nothing to train on, refused at start."""

import verifiers.v1 as vf


class MetricOnlyTask(vf.Task[vf.TaskData]):
    @vf.metric
    async def chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class MetricOnlyTaskset(vf.Taskset[MetricOnlyTask, vf.TasksetConfig]):
    def load(self):
        return [MetricOnlyTask(vf.TaskData(prompt="1+1="), self.config.task)]


__all__ = ["MetricOnlyTaskset"]
