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
* A task set may be narrowed to some of the families (``FAMILIES``; the
  config's ``data.<split>.families``): the pool keeps the same functions, split
  and order, less those of the other families.
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

Agent tasks (``make_agent_tasks``) are the same functions with the points
hidden: the prompt is ``AGENT_PROMPT`` (no point, no digit), and the task's
``files`` hold ``f.py``, which the agent reads ``f`` through, one point per
call of the tool ``f`` (``AGENT_TOOLS``), before it answers with an
expression. ``python3 f.py <x>`` reads f at any integer ``x``, keeps the points
read so far in ``points.txt`` of the session's work folder and prints them all,
sorted (``f(0)=1 f(2)=5``); any other argument prints a one-line error to
stderr and exits 1. The answer may be written ``f(x)=<expression>``
(``agent_answer`` takes the expression). An external scaffold has no tool
``f``: its prompt is ``external_agent_prompt`` (run ``python f.py <x>``, write
the expression to the answer file), chosen by dockyard/tasks/instructions.py.
The tests, the reference solution and the split of each function are those of
``make_tasks`` with the same ``(split, n, seed)``, in the same order, so the
answer is scored exactly like a single-turn completion (``program_for``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace
from functools import cache

from dockyard.tasks.task import Task, draw

SHOWN_INPUTS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
HELD_OUT_INPUTS: tuple[int, ...] = (7, 10)
TEST_INPUTS: tuple[int, ...] = SHOWN_INPUTS + HELD_OUT_INPUTS

# Roughly one function in four goes to validation.
_VALIDATION_BUCKETS = 4
SPLITS = ("train", "validation")


def _linear(a: int, b: int) -> str:
    term = "x" if a == 1 else f"{a}*x"
    return term if b == 0 else f"{term}{'+' if b > 0 else '-'}{abs(b)}"


# The families of the templates, simplest first.
FAMILIES: tuple[str, ...] = ("x+b", "a*x+b", "x*x+b", "a*x*x+b")


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


def _narrowed(split: str, families: Sequence[str]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """The split's pool, only ``families`` (all of them when empty)."""
    _check_split(split)
    if unknown := sorted(set(families) - set(FAMILIES)):
        raise ValueError(f"unknown function families {unknown}: the families are {list(FAMILIES)}")
    pool = tuple(f for f in _pool(split) if f[0] in families) if families else _pool(split)
    if not pool:
        raise ValueError(f"the {split} split has no function of the families {list(families)}")
    return pool


def pool_size(split: str, families: Sequence[str] = ()) -> int:
    """Number of distinct functions in a split (of ``families`` only, when given)."""
    return len(_narrowed(split, families))


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


def make_tasks(split: str, n: int, seed: int = 0, families: Sequence[str] = ()) -> list[Task]:
    """``n`` tasks of ``split`` (of ``families`` only, when given), deterministic for the arguments."""
    pool = _narrowed(split, families)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    drawn = draw(pool, n, f"expr:{split}:{seed}")
    return [_task(split, i, family, expr, outputs) for i, (family, expr, outputs) in enumerate(drawn)]


def program_for(completion: str) -> str:
    """Program source defining ``f`` from the first line of ``completion``."""
    body = completion.split("\n", 1)[0].strip()
    return f"def f(x):\n    return {body}\n"


# Every character is a token of the tiny model's character tokenizer: keep it short, within its CHARSET.
AGENT_PROMPT = "find f(x)."


def external_agent_prompt(answer_file: str) -> str:
    """An external scaffold's prompt (dockyard/tasks/instructions.py): it has no tool `f`, but a shell in
    the session that holds f.py, and hands its answer in as the text of `answer_file`. Lowercase, no
    digit: every character a token of the tiny model, and no point shown. The bare expression (which
    agent_answer takes as it takes `f(x)=...`) is written without quotes, `echo 2*x+1 > answer.txt`,
    so the tool call needs no backslash, which the tiny model cannot write."""
    return f"find f(x). run python f.py <x> to read f(<x>). write f as an expression in x to {answer_file}."


# The agent's tool in OpenAI format, as a scaffold sends it with each request.
AGENT_TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "f at one integer point, with the points read before",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
]

# The solution is one of the fixed templates above, never user input, so it can be inlined as code.
# The points read so far live in the session's work folder (points.txt), so each call reports them all.
_F_PROGRAM = """import sys

try:
    x = int(sys.argv[1])
except (IndexError, ValueError):
    sys.exit("f takes one integer argument")
seen = {{}}
try:
    with open("points.txt") as saved:
        for line in saved:
            k, v = line.split()
            seen[int(k)] = int(v)
except (FileNotFoundError, ValueError):
    pass
seen[x] = {expr}
with open("points.txt", "w") as saved:
    saved.write("".join(f"{{k}} {{v}}\\n" for k, v in sorted(seen.items())))
print(" ".join(f"f({{k}})={{v}}" for k, v in sorted(seen.items())))
"""


# An agent may write its answer as `f(x)=<expression>`: the expression is what is scored.
ANSWER_PREFIX = "f(x)="


def agent_answer(text: str) -> str:
    """The expression of an agent's answer: its first line, without a leading ``f(x)=``."""
    line = text.strip().split("\n", 1)[0].strip()
    return line[len(ANSWER_PREFIX) :].strip() if line.startswith(ANSWER_PREFIX) else line


def f_program(solution: str) -> str:
    """Source of ``f.py``: reads f at the integer argument and prints every point read so far."""
    return _F_PROGRAM.format(expr=solution)


def f_output(solution: str, xs) -> str:
    """What ``f.py`` prints after reading the points ``xs`` (in any order, without the newline)."""
    return " ".join(f"f({x})={_evaluate(solution, x)}" for x in sorted(set(xs)))


def make_agent_tasks(split: str, n: int, seed: int = 0, families: Sequence[str] = ()) -> list[Task]:
    """The functions of ``make_tasks(split, n, seed, families)`` as agent tasks: hidden points, ``f.py`` to query."""
    return [
        replace(
            task,
            task_id=task.task_id.replace("expr-", "expr-agent-", 1),
            prompt=AGENT_PROMPT,
            files=(("f.py", f_program(task.solution)),),
        )
        for task in make_tasks(split, n, seed, families)
    ]
