"""Tiny recipe: warm start for integer-function synthesis on a CPU.

``warm_start`` trains a randomly initialised character-level causal LM with
supervised fine-tuning on ``make_tasks("train", ...)`` (prompt followed by a
demonstrated expression and ``<eos>``; cross-entropy on the completion tokens
only) and writes a complete Hugging Face folder: weights as safetensors,
config, generation config, tokenizer, and ``warm_start.json`` with the
training settings and loss summary. The folder loads with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.

The demonstrations come from an imperfect demonstrator: with probability
``shortcut_rate`` it answers with the line through the first two shown
examples (``line_through_first_two``) instead of the reference. That is right
for the linear half of the tasks and wrong for the quadratic half, so with the
recipe's rate of 0.6 the warm-started policy prefers the line under greedy
decoding yet samples the curve often enough for GRPO to find it. The fix is
one behaviour shared by all quadratic tasks, so what GRPO learns on training
tasks carries over to validation tasks. Without the shortcut (rate 0.0) the
remaining errors are arithmetic slips specific to each function, and 30 GRPO
steps of 64 samples do not move validation accuracy measurably.

With ``answer="values"`` (``demonstrated_expression``) every demonstration is
spelled with the shown values f(0)=y0 and f(1)=y1: the curve of the task's
family through them, or the shortcut's line ``y0+y1*x-y0*x``. Nothing is
computed, only copied, and curve or line is one token's choice after
``y0+y1*x``.

Guarantees:

* The folder is assembled under a temporary sibling name and renamed into
  place only when complete, so ``out_dir`` is either absent, the previous
  complete folder, or the new complete folder. An existing ``out_dir`` is
  replaced.
* For a fixed seed, config and thread count the written weights are
  identical across runs (CPU, float32).
* ``AutoTokenizer.from_pretrained(out_dir)`` encodes exactly like the
  character tokenizer that was trained with; a model type for which it would
  not (``qwen2`` makes AutoTokenizer substitute its own class) is refused
  with ``ValueError`` before anything is renamed into place.
* ``num_threads`` applies to the training only; the previous torch setting is
  restored afterwards.

``new_policy``, ``fit``, ``pad_rows``, ``generation_config``, ``line_expression``
and ``write_atomically`` are shared with the agent recipe (``tiny_agent``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from dockyard.models.build import DEFAULT_MODEL, build_random_model
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.tasks.expr import make_tasks
from dockyard.tasks.task import Task

# The recipe's values live in examples/configs/tiny_expr.yaml; this is the
# demonstrator's default, measured to leave GRPO a visible gain.
SHORTCUT_RATE = 0.6
# A completion is one short expression; the saved generation config says so.
MAX_NEW_TOKENS = 16

WARM_START_META = "warm_start.json"


def encode_sft_batch(tokenizer: PreTrainedTokenizerFast, tasks: Sequence[Task]) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels masked to the completion."""
    rows: list[tuple[list[int], list[int]]] = []
    for task in tasks:
        prompt = tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
        completion = tokenizer(task.solution, add_special_tokens=False)["input_ids"]
        completion = completion + [tokenizer.eos_token_id]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    return pad_rows(rows, tokenizer.pad_token_id)


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """``prompt`` as the policy endpoint renders a chat of one user message, up to the generation prompt."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def pad_rows(rows: Sequence[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask and labels from ``(ids, labels)`` rows (-100: no loss)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(labs)] = torch.tensor(labs)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


_EXAMPLE = re.compile(r"f\((-?\d+)\)=(-?\d+)")


def line_through_first_two(task: Task) -> str:
    """The expression of the line through the first two shown examples.

    This is the demonstrator's shortcut: exact for linear functions, wrong
    for every non-linear one, yet plausible-looking.
    """
    (x0, y0), (x1, y1) = [(int(a), int(b)) for a, b in _EXAMPLE.findall(task.prompt)[:2]]
    slope = (y1 - y0) // (x1 - x0)
    return line_expression(slope, y0 - slope * x0)


def values_expression(y0: int, y1: int, square: bool = False) -> str:
    """The line through f(0)=y0 and f(1)=y1 (with ``square``, the curve ``a*x*x+b`` through them) spelled
    with those values, ``y0+y1*x-y0*x`` (``y0+y1*x*x-y0*x*x``): copied, no arithmetic. A tiny model learns
    to copy values long before it learns their difference; on its family's functions it is exact."""
    term = "x*x" if square else "x"
    return f"{y0}+{y1}*{term}-{y0}*{term}"


ANSWERS = ("reference", "values")


def check_answer(answer: str) -> None:
    """Refuse a demonstrator spelling other than ``ANSWERS``."""
    if answer not in ANSWERS:
        raise ValueError(f"answer must be reference or values, got {answer!r}")


def demonstrated_expression(task: Task, shortcut: bool, answer: str) -> str:
    """The single-turn demonstrator's answer on ``task``: the line through the first two shown examples
    (``shortcut``) or the reference, spelled as ``answer`` says: ``reference`` (the task's own spelling;
    the line as ``line_expression``) or ``values`` (``values_expression``, in the task's family's shape)."""
    check_answer(answer)
    if answer == "values":
        (_, y0), (_, y1) = [(int(a), int(b)) for a, b in _EXAMPLE.findall(task.prompt)[:2]]
        return values_expression(y0, y1, square=not shortcut and "x*x" in task.solution)
    return line_through_first_two(task) if shortcut else task.solution


def line_expression(slope: int, intercept: int) -> str:
    """``slope*x+intercept`` spelled as the task templates spell lines (``x+3``, ``2*x-1``, ``5``)."""
    if slope == 0:
        return str(intercept)
    if slope == -1 and intercept > 0:
        return f"{intercept}-x"
    term = {1: "x", -1: "-x"}.get(slope, f"{slope}*x")
    if intercept == 0:
        return term
    return f"{term}{'+' if intercept > 0 else '-'}{abs(intercept)}"


def _lr_factor(step: int, steps: int) -> float:
    # Short linear warmup, then cosine decay to 10% of the peak.
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warm_start(
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
    chat: bool = False,
    families: Sequence[str] = (),
    answer: str = "reference",
) -> Path:
    """Train the SFT warm start on the training tasks of ``families`` (all when empty) and write it to
    ``out_dir``; returns ``out_dir``. With ``chat``, each prompt is rendered as one user turn of the
    tokenizer's chat template (``chat_prompt``); ``answer`` is how demonstrations are spelled
    (``demonstrated_expression``)."""
    check_settings(steps, batch_size, shortcut_rate)
    out_dir = Path(out_dir)
    with torch_threads(num_threads):
        started = time.monotonic()
        policy, tokenizer = new_policy(model, seed)
        losses = _train(policy, tokenizer, steps, lr, batch_size, seed, progress, shortcut_rate, chat, families, answer)
        elapsed = time.monotonic() - started

    policy.generation_config = generation_config(tokenizer, MAX_NEW_TOKENS)
    meta = {
        "recipe": "tiny_expr",
        "model": {**DEFAULT_MODEL, **model},
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "shortcut_rate": shortcut_rate,
        "chat": chat,
        "families": list(families),
        "answer": answer,
        "num_threads": num_threads,
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "train_seconds": round(elapsed, 3),
    }
    write_atomically(out_dir, policy, tokenizer, meta)
    return out_dir


def check_settings(steps: int, batch_size: int, shortcut_rate: float) -> None:
    """The warm-start settings every recipe takes, refused with a message when out of range."""
    if steps < 1 or batch_size < 1:
        raise ValueError("steps and batch_size must be >= 1")
    if not 0.0 <= shortcut_rate <= 1.0:
        raise ValueError(f"shortcut_rate must be in [0, 1], got {shortcut_rate}")


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's thread count set to `num_threads` (None: unchanged) for the body, then restored."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def new_policy(model: dict[str, Any], seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A randomly initialised ``model`` and the character tokenizer it is sized and wired for."""
    tokenizer = build_char_tokenizer()
    policy = build_random_model(
        model,
        vocab_size=len(tokenizer),
        seed=seed,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return policy, tokenizer


def generation_config(tokenizer: PreTrainedTokenizerFast, max_new_tokens: int) -> GenerationConfig:
    """The saved generation defaults: the tokenizer's special ids, at most ``max_new_tokens``."""
    return GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        max_new_tokens=max_new_tokens,
    )


def _train(
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: Callable[[int, float], None] | None,
    shortcut_rate: float,
    chat: bool = False,
    families: Sequence[str] = (),
    answer: str = "reference",
) -> list[float]:
    tasks = make_tasks("train", steps * batch_size, seed=seed, families=families)
    rng = random.Random(seed)
    # make_tasks walks permutations of the pool; shuffle once more so a batch
    # mixes the end of one permutation with others deterministically.
    rng.shuffle(tasks)
    tasks = [replace(t, solution=demonstrated_expression(t, rng.random() < shortcut_rate, answer)) for t in tasks]
    if chat:
        tasks = [replace(t, prompt=chat_prompt(tokenizer, t.prompt)) for t in tasks]
    return fit(
        policy,
        lambda step: encode_sft_batch(tokenizer, tasks[step * batch_size : (step + 1) * batch_size]),
        steps,
        lr,
        progress,
    )


def fit(
    policy: torch.nn.Module,
    batch_at: Callable[[int], dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    progress: Callable[[int, float], None] | None,
) -> list[float]:
    """``steps`` AdamW steps on ``batch_at(step)`` under the warm-start schedule; the losses."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    policy.train()
    losses: list[float] = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * _lr_factor(step, steps)
        loss = policy(**batch_at(step)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step, losses[-1])
    policy.eval()
    return losses


def _check_tokenizer_reloads(folder: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    # Some model types make AutoTokenizer substitute their own tokenizer class
    # (e.g. qwen2), which would silently re-tokenize every prompt.
    probe = "f(0)=-3 f(1)=10\nf(x)= x%4+9"
    loaded = AutoTokenizer.from_pretrained(folder)
    expected = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if loaded(probe, add_special_tokens=False)["input_ids"] != expected:
        raise ValueError(
            f"AutoTokenizer loads {type(loaded).__name__} from {folder}, which does not "
            "reproduce the character tokenizer; choose another model_type"
        )


def write_atomically(
    out_dir: Path,
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    meta: dict[str, Any],
) -> None:
    """Write the folder under a temporary sibling name, check its tokenizer, rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    retired = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        policy.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / WARM_START_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _check_tokenizer_reloads(staging, tokenizer)
        if out_dir.exists():
            os.replace(out_dir, retired)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
