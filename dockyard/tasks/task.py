"""The task type every environment produces and the collector consumes.

A task is one prompt plus what the sandbox needs to score a completion of it. Tasks are frozen,
so one task may be drawn again (task sets cycle when more are asked for than they hold) and shared
between callers without copies.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    * ``answer``: the reference answer a model judge compares a response with (``hle``); empty elsewhere.
    * ``max_seconds``: the task's own wall-clock budget for an agent trial (terminal tasks:
      ``max_agent_timeout_sec``); the trial gets the smaller of it and ``grpo.max_trial_seconds``.
      None: only the job's budget.
    * ``messages``: ``(role, content)`` pairs of a chat prompt (dataset rows with messages): the policy
      completes them rendered through its tokenizer's chat template; ``prompt`` then holds the last
      user message, for people to read. Empty: ``prompt`` is the text the policy completes.
    * ``answer``: a dataset row's reference answer (any JSON value), for reward functions; None: none.
    * ``metadata``: further columns of the row (``data.<split>.fields.metadata``), for reward functions.
    * ``completes_prompt``: the completion continues the prompt's code (HumanEval-shaped rows): the
      program is the prompt plus the completion; otherwise the program is the completion's code.
    """

    task_id: str
    prompt: str
    tests: tuple[str, ...]
    solution: str
    files: tuple[tuple[str, str], ...] = ()
    max_seconds: float | None = None
    messages: tuple[tuple[str, str], ...] = ()
    # Excluded from the hash (JSON values may be lists or dicts), compared as usual.
    answer: Any = field(default=None, hash=False)
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)
    completes_prompt: bool = False


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
