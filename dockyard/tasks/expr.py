"""Integer-function synthesis tasks for the tiny recipe.

A task shows input/output examples of an unknown integer function ``f`` and
asks for a Python expression in ``x`` that computes it::

    f(0)=1 f(1)=3 f(2)=5 f(3)=7 f(4)=9 f(5)=11
    f(x)=

with reference completion ``2*x+1``.

Guarantees:

* The function family is a fixed, ordered list of expression templates with a
  difficulty gradient: ``x+b`` (read ``b`` off ``f(0)``), ``a*x+b`` (also
  needs ``a = f(1)-f(0)``), ``x*x+b`` and ``a*x*x+b`` (same reading, plus
  noticing the curvature), with ``a`` in 1..9 and ``b`` in -9..30. Half of
  the functions are linear and half quadratic.
  A function whose shown examples coincide with those of an earlier
  (simpler) template is dropped, so the examples identify each task's
  function, each task has one canonical reference ``solution``, and no two
  tasks differ only in how the same function is written.
* The ``train`` and ``validation`` splits are disjoint at the function level:
  the split of a function is decided by a hash of its signature, so a
  validation function never appears in training under any spelling.
* The prompt shows ``f`` at ``SHOWN_INPUTS``; ``tests`` assert ``f`` at those
  inputs and at ``HELD_OUT_INPUTS``. The held-out points reward the function
  rather than a fit to the shown points, and make partial credit (fraction of
  tests passed) informative: a wrong guess that still matches some points
  earns something (the line through the first two examples of a quadratic
  passes 2 of 8 tests), an exact one earns 1.0.
* ``make_tasks`` is deterministic for ``(split, n, seed)``. It walks a seeded
  permutation of the split's functions and starts a new permutation when it
  runs out, so ``n`` may exceed the number of distinct functions (useful for
  training; a validation set should keep ``n <= pool size`` to avoid repeats,
  see ``pool_size``).
* ``program_for`` turns a completion into the program the sandbox runs: only
  the first line of the completion is used, as the body of ``f``.
"""

from __future__ import annotations

import hashlib
import random
from functools import cache

from dockyard.tasks.task import Task

SHOWN_INPUTS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
HELD_OUT_INPUTS: tuple[int, ...] = (7, 10)
TEST_INPUTS: tuple[int, ...] = SHOWN_INPUTS + HELD_OUT_INPUTS

# Roughly one function in four goes to validation.
_VALIDATION_BUCKETS = 4
SPLITS = ("train", "validation")


def _linear(a: int, b: int) -> str:
    term = "x" if a == 1 else f"{a}*x"
    return term if b == 0 else f"{term}{'+' if b > 0 else '-'}{abs(b)}"


def _templates() -> list[tuple[str, str]]:
    """(family, expression) in order of increasing difficulty.

    Every linear function ``a*x+b`` has a quadratic twin ``a*x*x+b`` with the
    same first two examples, so telling them apart needs the later examples.
    """
    out: list[tuple[str, str]] = []
    out += [("x+b", _linear(1, b)) for b in range(-9, 31) if b != 0]
    out += [("a*x+b", _linear(a, b)) for a in range(2, 10) for b in range(-9, 31)]
    out += [("x*x+b", "x*" + _linear(1, b)) for b in range(-9, 31)]
    out += [("a*x*x+b", _linear(a, b).replace("*x", "*x*x", 1)) for a in range(2, 10) for b in range(-9, 31)]
    return out


def _evaluate(expr: str, x: int) -> int:
    # The templates are fixed literals above, never user input.
    return int(eval(expr, {"__builtins__": {}}, {"x": x}))


def _split_of(signature: tuple[int, ...]) -> str:
    digest = hashlib.sha256(repr(signature).encode()).digest()
    return "validation" if digest[0] % _VALIDATION_BUCKETS == 0 else "train"


@cache
def _pool(split: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Canonical (family, solution, outputs) of every function in a split."""
    seen_shown: set[tuple[int, ...]] = set()
    pool = []
    for family, expr in _templates():
        outputs = tuple(_evaluate(expr, x) for x in TEST_INPUTS)
        shown = outputs[: len(SHOWN_INPUTS)]
        # A function is only a task if the shown examples identify it: the
        # simpler template wins any tie, so the reference is unambiguous.
        if shown in seen_shown:
            continue
        seen_shown.add(shown)
        if _split_of(outputs) == split:
            pool.append((family, expr, outputs))
    return tuple(pool)


def pool_size(split: str) -> int:
    """Number of distinct functions in a split."""
    _check_split(split)
    return len(_pool(split))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _prompt(outputs: tuple[int, ...]) -> str:
    shown = " ".join(f"f({x})={y}" for x, y in zip(SHOWN_INPUTS, outputs[: len(SHOWN_INPUTS)], strict=True))
    return f"{shown}\nf(x)="


def _task(split: str, index: int, family: str, expr: str, outputs: tuple[int, ...]) -> Task:
    tests = tuple(f"assert f({x}) == {y}" for x, y in zip(TEST_INPUTS, outputs, strict=True))
    return Task(
        task_id=f"expr-{split}-{index:06d}-{family}",
        prompt=_prompt(outputs),
        tests=tests,
        solution=expr,
    )


def make_tasks(split: str, n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks of ``split``, deterministic for ``(split, n, seed)``."""
    _check_split(split)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = _pool(split)
    rng = random.Random(f"expr:{split}:{seed}")
    tasks: list[Task] = []
    order: list[int] = []
    while len(tasks) < n:
        if not order:
            order = list(range(len(pool)))
            rng.shuffle(order)
        family, expr, outputs = pool[order.pop()]
        tasks.append(_task(split, len(tasks), family, expr, outputs))
    return tasks


def program_for(completion: str) -> str:
    """Program source defining ``f`` from the first line of ``completion``."""
    body = completion.split("\n", 1)[0].strip()
    return f"def f(x):\n    return {body}\n"
