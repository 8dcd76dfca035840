"""Find an integer function: a small environment on `verifiers` (0.4.0, `verifiers.v1`).

    load_environment(mode, split, size, seed, families) ──> FunctionTaskset (a vf.Taskset of FunctionTask)
        mode "single": prompt "f(0)=1 f(1)=3 ... f(5)=11\\nf(x)="; the reply's first line is the answer
        mode "tool":   prompt "find f(x)."; FunctionToolset's tool f(x) reads f at one point (and reports
                       every point read so far); the last reply without a tool call is the answer
    FunctionTask.correct (@vf.reward) ──> the fraction of POINTS where the answer's expression equals f

Guarantees: the tasks are a pure function of (split, size, seed, families); the "train" and "eval" splits
hold disjoint functions, split by the rule of dockyard's own expression tasks (dockyard/tasks/expr.py: a
hash of the function's values at POINTS), so an eval function is never one of dockyard's training
functions either; an answer is evaluated only when it is a plain arithmetic expression in x (digits,
x, + - * and brackets, at most 64 characters), never as arbitrary code; every prompt and tool result
uses only lowercase letters, digits and `()=.+-*` and spaces.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.types import content_text

SHOWN = (0, 1, 2, 3, 4, 5)
POINTS = (*SHOWN, 7, 10)  # the answer is checked beyond the points a prompt shows
TOOL_PROMPT = "find f(x)."
ANSWER_PREFIX = "f(x)="
_EXPRESSION = re.compile(r"[0-9x+\-*() ]{1,64}")
FAMILIES = ("x+b", "a*x+b", "x*x+b", "a*x*x+b")


def functions(split: str, families: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Every function of a split (of ``families`` only, when given), as an expression in x: a*x+b and
    a*x*x+b (a in 1..9, b in -9..30), one in four of them (by a hash of its values at POINTS) in "eval"."""
    if unknown := sorted(set(families) - set(FAMILIES)):
        raise ValueError(f"unknown families {unknown}: the families are {list(FAMILIES)}")
    out = []
    for square in ("x", "x*x"):
        for a in range(1, 10):
            if families and f"{'' if a == 1 else 'a*'}{square}+b" not in families:
                continue
            for b in range(-9, 31):
                term = square if a == 1 else f"{a}*{square}"
                expr = term if b == 0 else f"{term}{b:+d}"
                digest = hashlib.sha256(repr(tuple(value(expr, x) for x in POINTS)).encode()).digest()
                if (digest[0] % 4 == 0) == (split == "eval"):
                    out.append(expr)
    return out


def value(expr: str, x: int) -> int | None:
    """expr at x, or None when expr is not a plain arithmetic expression in x (or fails)."""
    if not _EXPRESSION.fullmatch(expr) or "**" in expr:
        return None
    try:
        result = eval(expr, {"__builtins__": {}}, {"x": x})  # checked above: digits, x, + - * ( ) only
    except Exception:
        return None
    return result if isinstance(result, int) else None


def answer_of(reply: str) -> str:
    """The expression of a reply: its first line, without a leading `f(x)=`."""
    line = reply.strip().split("\n", 1)[0].strip()
    return line[len(ANSWER_PREFIX) :].strip() if line.startswith(ANSWER_PREFIX) else line


class FunctionData(vf.TaskData):
    solution: str = ""


class FunctionTaskConfig(vf.TaskConfig):
    mode: Literal["single", "tool"] = "single"


class FunctionToolset(vf.Toolset):
    """The tool of mode "tool", task-scoped: set up for one rollout's task, it keeps that rollout's points."""

    TOOL_PREFIX = None  # the tool is `f`, as the prompt says

    async def setup_task(self, task) -> None:
        self.solution: str = task.data.solution
        self.read: dict[int, int | None] = {}

    @vf.tool
    async def f(self, x: int) -> str:
        """f at one integer point, with the points read before"""
        self.read[x] = value(self.solution, x)
        return " ".join(f"f({k})={v}" for k, v in sorted(self.read.items()))


class FunctionTask(vf.Task[FunctionData, vf.State, FunctionTaskConfig]):
    @classmethod
    def toolsets(cls, config: FunctionTaskConfig) -> list[vf.Toolset]:
        return [FunctionToolset(vf.ToolsetConfig())] if config.mode == "tool" else []

    @vf.reward
    async def correct(self, task: FunctionData, trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant" and not m.tool_calls]
        if not replies:
            return 0.0
        expr = answer_of(content_text(replies[-1].content))
        return sum(value(expr, x) == value(task.solution, x) for x in POINTS) / len(POINTS)


class FunctionTasksetConfig(vf.TasksetConfig):
    mode: Literal["single", "tool"] = "single"
    split: Literal["train", "eval"] = "train"
    size: int = 256
    seed: int = 0
    families: list[str] = []


class FunctionTaskset(vf.Taskset[FunctionTask, FunctionTasksetConfig]):
    def load(self):
        c = self.config
        pool = functions(c.split, c.families)
        random.Random(f"{c.split}:{c.seed}").shuffle(pool)
        for i in range(c.size):
            expr = pool[i % len(pool)]
            shown = " ".join(f"f({x})={value(expr, x)}" for x in SHOWN)
            prompt = TOOL_PROMPT if c.mode == "tool" else f"{shown}\n{ANSWER_PREFIX}"
            data = FunctionData(id=f"{c.split}-{i}", prompt=prompt, solution=expr)
            yield FunctionTask(data, FunctionTaskConfig(mode=c.mode))


def load_environment(
    mode: Literal["single", "tool"] = "single",
    split: str = "train",
    size: int = 256,
    seed: int = 0,
    families: list[str] | None = None,
) -> FunctionTaskset:
    """The environment's tasks: `size` functions of `split` (of `families` only, when given: "x+b",
    "a*x+b", "x*x+b", "a*x*x+b"), in a seeded order."""
    config = FunctionTasksetConfig(
        id="dockyard_verifiers_example", mode=mode, split=split, size=size, seed=seed, families=families or []
    )
    return FunctionTaskset(config)
