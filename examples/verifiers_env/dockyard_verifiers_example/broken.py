"""The example's tasks with a rubric that raises: what a trial of a broken environment looks like."""

from __future__ import annotations

import verifiers.v1 as vf

from dockyard_verifiers_example import FunctionData, FunctionTask, FunctionTaskset, FunctionTasksetConfig


class BrokenTask(FunctionTask):
    @vf.reward
    async def correct(self, task: FunctionData, trace) -> float:
        return 1 / 0


class BrokenTaskset(FunctionTaskset):
    def load(self):
        for task in super().load():
            yield BrokenTask(task.data, task.config)


def load_environment(mode: str = "single", split: str = "train", size: int = 16, seed: int = 0) -> BrokenTaskset:
    return BrokenTaskset(
        FunctionTasksetConfig(id="dockyard_verifiers_example", mode=mode, split=split, size=size, seed=seed)
    )
