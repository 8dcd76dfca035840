"""Tiny agent recipe: warm start for the multi-turn integer-function task on a CPU.

``warm_start_agent`` trains a randomly initialised character-level causal LM
(``AGENT_MODEL``: the tiny recipe's shape with room for a whole trial) on
demonstrated trials of ``make_agent_tasks("train", ...)``: the agent calls the
tool ``f`` at a few points, reads the results (each reports every point read
so far), and answers ``f(x)=<expression in x>``, a reply without a tool call.
It writes a Hugging Face folder like ``tiny_expr.warm_start`` (same atomic
rename, tokenizer check and ``warm_start.json``).

One training row is one whole trial, tokenized as the policy endpoint records
a session (``trial_tokens``): the rendered first prompt, then per assistant
turn the call text as the chat template renders it plus ``<eos>`` (the tokens
the policy writes, the only ones with loss), then the template's closing of
that turn and the rendering of the tool result up to the next generation
prompt (context, no loss). So what the model learns to write is what the
endpoint's Hermes parser reads, and the prompts it learns from are the ones
it will be given, token for token.

The answer's fixed ``f(x)=`` makes "answer now or read another point" one
token's choice (``f`` or the call's ``<``), and puts the expression right after
it, as in the single-turn recipe.

The demonstrator is imperfect on purpose, like ``tiny_expr``'s: with
probability ``shortcut_rate`` it reads f(0) and f(1) and answers the line
through them (right for the linear half of the tasks, wrong for the quadratic
half); otherwise it also reads f(2) and answers the reference. Whether to read
the third point is decided before any value could tell the two halves apart,
so the warm-started policy takes the shortcut under greedy decoding yet
samples the third call at temperature 1: the behaviour GRPO can reinforce, on
every task alike.

Those are the default points (``reads`` and ``shortcut_reads``); a recipe may
name others, and the function families its tasks are drawn from (the job's
``data.train.families``). A shortcut answers the line through the points it
read: slope 1 through a single point, ``x`` when it read none. A trial that
read nothing is never drilled as an answer. With ``answer="values"`` the
answers are spelled with the values read (``tiny_expr.values_expression``:
``y0+y1*x-y0*x`` for the line through f(0)=y0 and f(1)=y1): a tiny model
learns to copy the values long before it learns their difference.

Guarantees:

* ``trial_tokens`` equals the token ids and loss mask that the endpoint's
  session recorder keeps for the same conversation, when the policy wrote
  exactly the template's rendering of each call followed by ``<eos>``.
* For a fixed seed, config and thread count the written weights are identical
  across runs (CPU, float32); ``num_threads`` applies to the training only.
* The folder guarantees of ``tiny_expr.warm_start`` hold (atomic replace,
  tokenizer that reloads unchanged, refused model types).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from dockyard.models.build import DEFAULT_MODEL
from dockyard.recipes import mini_format
from dockyard.recipes.tiny_expr import (
    check_answer,
    check_settings,
    fit,
    generation_config,
    line_expression,
    new_policy,
    pad_rows,
    torch_threads,
    values_expression,
    write_atomically,
)
from dockyard.tasks.expr import AGENT_TOOLS, ANSWER_PREFIX, f_output, make_agent_tasks
from dockyard.tasks.task import Task

Message = dict[str, Any]

# The tiny recipe's shape; the longest demonstrated trial (three reads and the answer) is 331 tokens.
AGENT_MODEL: dict[str, Any] = {**DEFAULT_MODEL, "max_position_embeddings": 512}
SHORTCUT_RATE = 0.6
# One assistant turn is one call (about 50 tokens) or the answer.
MAX_NEW_TOKENS = 64
_VALUE = re.compile(r"f\(-?\d+\)=(-?\d+)")
# The points the demonstrator reads: the shortcut stops after two.
SHORTCUT_POINTS: tuple[int, ...] = (0, 1)
FULL_POINTS: tuple[int, ...] = (0, 1, 2)
# Every other warm-start step trains on short rows, the tail of a trial from its last tool result (where
# the arithmetic of the answer is), this many per trial of a trial step: cheap rows, many answers seen.
DRILLS_PER_TRIAL = 4


def call_message(index: int, name: str, arguments: dict[str, Any]) -> Message:
    """An assistant turn that calls one tool, as a scaffold echoes it back."""
    call = {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def demonstrated_answer(
    task: Task,
    shortcut: bool,
    reads: Sequence[int] = FULL_POINTS,
    shortcut_reads: Sequence[int] = SHORTCUT_POINTS,
    answer: str = "reference",
) -> tuple[tuple[int, ...], str]:
    """The demonstrator's reads of ``f`` on ``task`` and its answer: after ``reads``, the reference, or
    with ``answer="values"`` the curve of the task's family through f(0)=y0 and f(1)=y1 spelled with the
    values read (``values_expression``: ``y0+y1*x-y0*x`` on a line); with ``shortcut``, the line through
    the points of ``shortcut_reads`` (slope 1 where one point leaves it open, ``x`` where none is read;
    spelled with the values when ``answer="values"`` and it read f(0) and f(1))."""
    check_answer(answer)
    points = tuple(reads if not shortcut else shortcut_reads)
    values = dict(zip(sorted(points), _values(task, points), strict=True))
    read_both = {0, 1} <= values.keys()
    if answer == "values" and not shortcut and not read_both:
        raise ValueError(f"answer values reads f(0) and f(1), not only {list(reads)}")
    if answer == "values" and read_both:
        return points, values_expression(values[0], values[1], square=not shortcut and "x*x" in task.solution)
    if not shortcut:
        return points, task.solution
    if len(points) >= 2:
        (x0, x1) = sorted(points)[:2]
        slope = (values[x1] - values[x0]) // (x1 - x0)
        return points, line_expression(slope, values[x0] - slope * x0)
    if len(points) == 1:
        return points, line_expression(1, values[points[0]] - points[0])
    return points, line_expression(1, 0)


def _values(task: Task, points: Sequence[int]) -> list[int]:
    """f at ``points`` (sorted), as the tool reports them."""
    return [int(v) for v in _VALUE.findall(f_output(task.solution, points))] if points else []


def demonstration(
    task: Task,
    shortcut: bool,
    scaffold: str = "built_in",
    reads: Sequence[int] = FULL_POINTS,
    shortcut_reads: Sequence[int] = SHORTCUT_POINTS,
    answer: str = "reference",
) -> list[Message]:
    """The demonstrator's trial on ``task`` in ``scaffold``'s format: the built-in loop's (reads of the
    tool ``f`` and their results, then the answer as text) or mini-swe-agent's (mini_format)."""
    points, expression = demonstrated_answer(task, shortcut, reads, shortcut_reads, answer)
    if scaffold == "mini_swe_agent":
        return mini_format.demonstration(task, points, expression)
    messages: list[Message] = [{"role": "user", "content": task.prompt}]
    for i, x in enumerate(points):
        messages.append(call_message(i, "f", {"x": x}))
        content = f_output(task.solution, points[: i + 1])
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": content})
    messages.append({"role": "assistant", "content": f"{ANSWER_PREFIX}{expression}"})
    return messages


# The tools each scaffold's calls carry.
SCAFFOLD_TOOLS: dict[str, list[dict]] = {"built_in": AGENT_TOOLS, "mini_swe_agent": mini_format.MINI_TOOLS}


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )


def trial_tokens(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Sequence[dict] | None
) -> tuple[list[int], list[int]]:
    """Token ids of a whole trial and its loss mask (1 on what the policy wrote, ``<eos>`` included).

    ``messages`` start with the prompt messages and end with an assistant turn.
    """
    messages = list(messages)
    tools = list(tools) if tools else None
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0 or turns[-1] != len(messages) - 1:
        raise ValueError("messages must start with a prompt and end with an assistant turn")
    if any(b == a + 1 for a, b in zip(turns, turns[1:], strict=False)):
        raise ValueError("every assistant turn but the last must be followed by a tool or user message")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    ids = encode(_render(tokenizer, messages[: turns[0]], tools, True))
    mask = [0] * len(ids)
    for k, turn in enumerate(turns):
        history = messages[:turn]
        prompt = _render(tokenizer, history, tools, True)
        full = _render(tokenizer, [*history, messages[turn]], tools, False)
        empty = _render(tokenizer, [*history, {"role": "assistant", "content": ""}], tools, False)
        closing = empty[len(prompt) :]
        if not (full.startswith(prompt) and empty.startswith(prompt) and full.endswith(closing)):
            raise ValueError("the chat template does not render an assistant turn after its generation prompt")
        written = encode(full[len(prompt) : len(full) - len(closing)]) + [tokenizer.eos_token_id]
        ids += written
        mask += [1] * len(written)
        if k + 1 == len(turns):
            break
        # The closing, less what the policy wrote of it (its eos), then the new messages to the next prompt.
        said = tokenizer.decode(written, skip_special_tokens=False)
        kept = next((n for n in range(len(closing), 0, -1) if said.endswith(closing[:n])), 0)
        after = _render(tokenizer, messages[: turns[k + 1]], tools, True)
        if not after.startswith(full):
            raise ValueError("the chat template renders the history differently once a message follows it")
        context = encode(closing[kept:] + after[len(full) :])
        ids += context
        mask += [0] * len(context)
    return ids, mask


def warm_start_agent(
    out_dir: Path,
    *,
    model: dict[str, Any],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    num_threads: int | None = None,
    progress: Callable[[int, float], None] | None = None,
    shortcut_rate: float = SHORTCUT_RATE,
    scaffold: str = "built_in",
    reads: Sequence[int] = FULL_POINTS,
    shortcut_reads: Sequence[int] = SHORTCUT_POINTS,
    families: Sequence[str] = (),
    answer: str = "reference",
) -> Path:
    """Train the agent warm start on demonstrated trials in ``scaffold``'s format (``built_in`` or
    ``mini_swe_agent``) of the training tasks of ``families`` (all when empty), and write it to
    ``out_dir``; returns ``out_dir``."""
    check_settings(steps, batch_size, shortcut_rate)
    if scaffold not in SCAFFOLD_TOOLS:
        raise ValueError(f"scaffold must be one of {sorted(SCAFFOLD_TOOLS)}, got {scaffold!r}")
    out_dir = Path(out_dir)
    model = {**AGENT_MODEL, **model}
    with torch_threads(num_threads):
        started = time.monotonic()
        policy, tokenizer = new_policy(model, seed)
        demonstrator = Demonstrator(
            shortcut_rate, scaffold, tuple(reads), tuple(shortcut_reads), tuple(families), answer
        )
        rows = _demonstrated_rows(tokenizer, (steps + 1) // 2 * batch_size, seed, demonstrator)
        longest = max(len(ids) for ids, _ in rows)
        if longest > model["max_position_embeddings"]:
            raise ValueError(f"model.max_position_embeddings {model['max_position_embeddings']} < a trial's {longest}")
        # A trial that read nothing has no answer read from a result to drill (and its whole row would
        # drill the choice not to read); with no trial that read, the drills are whole trials.
        drills = [d for ids, labels in rows if (d := _answer_drill(tokenizer, ids, labels))] or rows

        def batch_at(step: int) -> dict[str, torch.Tensor]:
            # Odd steps drill the answer on short rows, DRILLS_PER_TRIAL times as many.
            k = step // 2
            if step % 2:
                chosen = [
                    drills[(k * batch_size * DRILLS_PER_TRIAL + i) % len(drills)]
                    for i in range(batch_size * DRILLS_PER_TRIAL)
                ]
            else:
                chosen = [rows[(k * batch_size + i) % len(rows)] for i in range(batch_size)]
            return pad_rows(chosen, tokenizer.pad_token_id)

        losses = fit(policy, batch_at, steps, lr, progress)
        elapsed = time.monotonic() - started

    policy.generation_config = generation_config(tokenizer, MAX_NEW_TOKENS)
    meta = {
        "recipe": "tiny_agent",
        "model": model,
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "shortcut_rate": shortcut_rate,
        "scaffold": scaffold,
        "reads": list(reads),
        "shortcut_reads": list(shortcut_reads),
        "families": list(families),
        "answer": answer,
        "num_threads": num_threads,
        "longest_trial_tokens": longest,
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "train_seconds": round(elapsed, 3),
    }
    write_atomically(out_dir, policy, tokenizer, meta)
    return out_dir


def _answer_drill(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> tuple[list[int], list[int]] | None:
    """The tail of a trial from its last tool result on: the tokens the answer is read from, and the
    answer; None for a trial without a tool result."""
    marker = tokenizer.encode("\ntool: ", add_special_tokens=False)
    starts = [i for i in range(len(ids) - len(marker)) if ids[i : i + len(marker)] == marker]
    return (ids[starts[-1] + 1 :], labels[starts[-1] + 1 :]) if starts else None


@dataclass(frozen=True)
class Demonstrator:
    """Whose trials the warm start shows: how often it takes the shortcut, in which scaffold's format,
    what it reads either way, on which function families, and how it spells its full answer."""

    shortcut_rate: float
    scaffold: str
    reads: tuple[int, ...]
    shortcut_reads: tuple[int, ...]
    families: tuple[str, ...]
    answer: str


def _demonstrated_rows(
    tokenizer: PreTrainedTokenizerBase, n: int, seed: int, demo: Demonstrator
) -> list[tuple[list[int], list[int]]]:
    """``(ids, labels)`` of ``n`` demonstrated training trials, in a seeded order."""
    tasks = make_agent_tasks("train", n, seed=seed, families=demo.families)
    rng = random.Random(seed)
    rng.shuffle(tasks)
    # Trials repeat (a pool of a few hundred functions, two demonstrator choices): render each once.
    cache: dict[tuple[str, bool], tuple[list[int], list[int]]] = {}
    rows = []
    for task in tasks:
        key = (task.solution, rng.random() < demo.shortcut_rate)
        if key not in cache:
            messages = demonstration(task, key[1], demo.scaffold, demo.reads, demo.shortcut_reads, demo.answer)
            ids, mask = trial_tokens(tokenizer, messages, SCAFFOLD_TOOLS[demo.scaffold])
            cache[key] = (ids, [i if m else -100 for i, m in zip(ids, mask, strict=True)])
        rows.append(cache[key])
    return rows
