"""Datasets of demonstrations for supervised jobs (`sft.dataset`): prompt + completion, or chat messages.

    JSONL(.gz) ──read_demonstration_records──> records ──demonstration_pairs(render)──> [(context, completion)]
        {"prompt": str, "completion": str}           one pair
        {"messages": [{role, content, ...}, ...]}    one pair per assistant turn: the conversation before it,
         (+ optional "tools": [schemas])             rendered with the policy's chat template (and the tools
                                                     the conversation offered) and its generation prompt, then
                                                     what the assistant wrote
    [(context, completion)] ──batch_at(step)──> the step's demonstrations (seeded order, a new one each epoch)

Guarantees:
- A multi-turn record trains each assistant turn exactly once and no other message (the loss mask
  on assistant turns): the trainer's loss covers completion tokens only, and every assistant turn
  is one completion whose context is everything before it, as dockyard's own agent trials lay them out
  (the turn's text as the policy writes it, without the template's closing; the trainer adds eos).
- Bad input is a ValueError naming the file, the line and what is wrong (read_records' format).
- `batch_at` depends only on (step, batch size, seed): a resumed job draws the same demonstrations.
- Files are read by `read_demonstration_records` alone, the one place that can switch to a generic
  rows reader (JSONL, Parquet, dataset folders) without touching the rest.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from dockyard.tasks.jsonl import read_records

Message = dict[str, Any]
# messages, generation prompt, tool schemas (or None) -> the text the chat template renders
Render = Callable[[list[Message], bool, list[dict] | None], str]
Pair = tuple[str, str]


def read_demonstration_records(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) of every record in a JSONL(.gz) file of demonstrations."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sft.dataset={str(path)!r}: no such file (a JSONL of prompt/completion or messages records)")
    return read_records(path.read_bytes(), str(path), fields=())


def is_chat(records: Sequence[tuple[int, dict]]) -> bool:
    """Whether any record holds chat messages (rendering them needs the policy's chat template)."""
    return any("messages" in record for _, record in records)


def demonstration_pairs(records: Sequence[tuple[int, dict]], origin: str, render: Render | None) -> list[Pair]:
    """Every record as (context text, completion text) pairs; `render` is needed for messages records."""
    pairs: list[Pair] = []
    for number, record in records:
        where = f"{origin}:{number}"
        if "messages" in record:
            if render is None:
                raise ValueError(f"{where}: a messages record needs the policy's chat template to render it")
            tools = record.get("tools")
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f"{where}: tools is a list of tool schemas (objects), got {type(tools).__name__}")
            pairs += _turn_pairs(record["messages"], lambda m, g, tools=tools: render(m, g, tools), where)
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            if not record["completion"]:
                raise ValueError(f"{where}: empty completion (nothing to train on)")
            pairs.append((record["prompt"], record["completion"]))
        else:
            raise ValueError(
                f"{where}: a demonstration is {{'prompt': str, 'completion': str}} or {{'messages': [...]}}, "
                f"got keys {sorted(record)}"
            )
    if not pairs:
        raise ValueError(f"{origin}: no demonstrations in the file")
    return pairs


def _turn_pairs(messages: Any, render: Callable[[list[Message], bool], str], where: str) -> list[Pair]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{where}: messages is a list of {{'role': ..., 'content': ...}} objects")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(f"{where}: messages need a prompt message and then at least one assistant turn")
    pairs = []
    for turn in turns:
        history = messages[:turn]
        context = render(history, True)
        full = render([*history, messages[turn]], False)
        closing = render([*history, {"role": "assistant", "content": ""}], False)[len(context) :]
        if not full.startswith(context) or not full.endswith(closing):
            raise ValueError(f"{where}: the chat template does not render assistant turn {turn} after its prompt")
        pairs.append((context, full[len(context) : len(full) - len(closing)]))
    return pairs


def batch_at(pairs: Sequence[Pair], step: int, batch_size: int, seed: int) -> list[Pair]:
    """The demonstrations of supervised step `step` (1-based): consecutive slices of a seeded order of
    the dataset, reshuffled for every pass over it."""
    n = len(pairs)
    orders: dict[int, list[int]] = {}
    chosen = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, index = divmod(position, n)
        if epoch not in orders:
            orders[epoch] = list(range(n))
            random.Random(f"{seed}:{epoch}").shuffle(orders[epoch])
        chosen.append(pairs[orders[epoch][index]])
    return chosen


def load_demonstrations(path: str | Path, policy: Any) -> list[Pair]:
    """The pairs of `sft.dataset`; messages records render with `policy`'s tokenizer's chat template."""
    records = read_demonstration_records(path)
    render = None
    if is_chat(records):
        from dockyard.models.load import load_tokenizer  # transformers only for chat datasets

        tokenizer = load_tokenizer(policy)

        def render(messages: list[Message], generation_prompt: bool, tools: list[dict] | None) -> str:
            return tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )

    return demonstration_pairs(records, str(path), render)


def export_best_trials(run_dir: str | Path, out: str | Path, min_reward: float) -> int:
    """Write a run's passing trials with reward >= min_reward as a new demonstrations file (`out` must not
    exist); the number of records written. Both kinds read the run's trials.jsonl, where the coordinator
    writes every passing training trial whole (`logger.save_trials`), never the few samples.jsonl keeps.

    A single-turn run: each (prompt, completion) once, as `{prompt, completion}`.
    An agent run: each conversation segment once, as `{messages, tools}`: every assistant turn trained,
    tool output and prompts only as context."""
    run_dir, out = Path(run_dir), Path(out)
    if out.exists():  # as `dockyard export hf`: an export never replaces what is there
        raise ValueError(f"{out} exists: name a new file")
    config = run_dir / "config.yaml"
    resolved = (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}
    env = resolved.get("env", {})
    source = run_dir / "trials.jsonl"
    if not source.is_file():
        if resolved and resolved.get("logger", {}).get("save_trials", True) and (run_dir / "metrics.jsonl").is_file():
            out.write_text("")  # a run that keeps its trials and wrote none had no passing trial
            return 0
        raise ValueError(
            f"{source}: no such file; a run writes its passing trials there (logger.save_trials, on by default) "
            "once a trial has passed; export-sft reads the trials.jsonl of a run folder (runs/<job-id>)"
        )
    if env.get("tools") or env.get("scaffold"):
        return _export_agent_trials(source, out, min_reward)
    kept: dict[tuple[str, str], None] = {}
    for _, row in read_records(source.read_bytes(), str(source), fields=("prompt", "completion", "reward")):
        if row["reward"] >= min_reward and row["completion"]:
            kept[(row["prompt"], row["completion"])] = None
    lines = [json.dumps({"prompt": prompt, "completion": completion}) for prompt, completion in kept]
    out.write_text("".join(line + "\n" for line in lines))
    return len(lines)


def _export_agent_trials(source: Path, out: Path, min_reward: float) -> int:
    kept: dict[str, None] = {}
    for _, row in read_records(source.read_bytes(), str(source), fields=("reward", "segments")):
        if row["reward"] < min_reward:
            continue
        for segment in row["segments"]:
            if any(m.get("role") == "assistant" for m in segment["messages"]):
                record = {"messages": segment["messages"], **({"tools": segment["tools"]} if segment["tools"] else {})}
                kept[json.dumps(record)] = None
    out.write_text("".join(line + "\n" for line in kept))
    return len(kept)
