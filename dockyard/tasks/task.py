"""The task type every environment produces and the collector consumes.

A task is one prompt plus what the sandbox needs to score a completion of it. Tasks are frozen,
so one task may be drawn again (task sets cycle when more are asked for than they hold) and shared
between callers without copies.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    """One prompt of a task set.

    * ``task_id``: names the task in logs and in the groups built from it; for ``swe`` it is
      ``<task set>/<instance_id>``, the two names ScorePatch asks the sandbox for.
    * ``prompt``: the text the policy completes.
    * ``tests``: Python test source the sandbox runs against the program built from a completion
      (``expr``: one assert per input; ``humaneval``: the problem's ``check``); empty for ``swe``,
      whose tests stay with the sandbox.
    * ``solution``: reference completion, the demonstration of SFT and of the tiny recipe's warm
      start; empty where the task set keeps its reference from the policy (``swe``: the gold patch
      stays with the sandbox).
    * ``files``: ``(relative path, content)`` pairs a sandbox session for the task starts with in its
      work folder (``expr`` agent tasks: ``f.py``, which the agent's tool runs); empty for tasks
      scored from a single completion.
    * ``max_seconds``: the task's own wall-clock budget for an agent trial (terminal tasks:
      ``max_agent_timeout_sec``); the trial gets the smaller of it and ``grpo.max_trial_seconds``.
      None: only the job's budget.
    """

    task_id: str
    prompt: str
    tests: tuple[str, ...]
    solution: str
    files: tuple[tuple[str, str], ...] = ()
    max_seconds: float | None = None


def draw(pool: Sequence[T], n: int, key: str) -> list[T]:
    """n items of `pool` in seeded permutations (random.Random(key)), a new one each time it runs out:
    the same (pool, n, key) gives the same list, and no item repeats before every item was drawn."""
    rng = random.Random(key)
    drawn: list[T] = []
    order: list[int] = []
    while len(drawn) < n:
        if not order:
            order = list(range(len(pool)))
            rng.shuffle(order)
        drawn.append(pool[order.pop()])
    return drawn
