"""The training tasks a job draws: seeded, shuffled per epoch, counted as they are drawn.

    data.train ─environment.load─> tasks ─shuffle per epoch (seeded)─> next(stream) ...   stream.drawn counts them

Guarantees: the order depends only on the tasks and the seed, so a stream that
skips its first `n` tasks draws exactly what an uninterrupted one draws after
`n`; `drawn` is the data position a checkpoint and the task cursor record.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from dockyard.config import MasterConfig
from dockyard.tasks.envs import split_tasks
from dockyard.tasks.task import Task


def load_tasks(config: MasterConfig, split: str) -> list[Task]:
    return split_tasks(config, split)


class TaskStream:
    """Endless, seeded, epoch-shuffled stream of training tasks."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        self._order = self._epochs(list(tasks), random.Random(seed))
        self.drawn = 0

    @staticmethod
    def _epochs(tasks: list[Task], rng: random.Random) -> Iterator[Task]:
        while True:
            order = tasks[:]
            rng.shuffle(order)
            yield from order

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        task = next(self._order)
        self.drawn += 1
        return task

    def skip(self, n: int) -> None:
        """Draw and drop `n` tasks: where a resumed job's stream stood."""
        for _ in range(n):
            next(self)
