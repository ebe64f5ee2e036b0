"""A verifiers taskset whose reward is a plain `def` (verifiers awaits every reward): refused at start."""

import verifiers.v1 as vf


class SyncTask(vf.Task[vf.TaskData]):
    @vf.reward
    def exact(self, trace: vf.Trace) -> float:
        return 1.0


class SyncTaskset(vf.Taskset[SyncTask, vf.TasksetConfig]):
    def load(self):
        return [SyncTask(vf.TaskData(prompt="1+1="), self.config.task)]


__all__ = ["SyncTaskset"]
