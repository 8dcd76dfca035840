"""Reasoning (`<think>...</think>`) in a completion: split off for the reply, asked for by budget or not at all.

    job's policy.reasoning + its chat template ──enabled──> whether the job's replies carry reasoning
    completion text ──split(text, opened)──> (reasoning or None, content)   (tool calls are parsed from content)
    Anthropic `thinking` | OpenAI `reasoning_effort` | Responses `reasoning` ──Thinking──> as trained, off, a budget

Guarantees: `split` never changes what is recorded: the completion's ids (think tokens included) are
sampled tokens and stay in the trajectory as they were sampled; only the reply shows the reasoning in
its own field. A completion that opens a block it never closes (it ran out of tokens) is all
reasoning with empty content. A model that does not reason (`enabled` false) has its text returned
as it is. A thinking request the endpoint cannot honour is a BadRequest naming the field; a request
to turn thinking off is honoured by the template's own switch (`enable_thinking=False`) or else by
an empty block written into the prompt as context; a budget of N caps the reasoning at N sampled
tokens (budget.py: the closing tag, when the model did not write it, is context, never trained).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from dockyard.algorithms.malformed import THINK_CLOSE, THINK_OPEN, unclosed_thinking
from services.endpoint.errors import BadRequest

OPEN, CLOSE = THINK_OPEN, THINK_CLOSE
# What a template that handles reasoning mentions: the tags, or the field its assistant messages carry.
TEMPLATE_MARKS = (OPEN, "reasoning_content")
SETTINGS = ("auto", "think", "none")
# Where a chat-template message carries an assistant turn's reasoning (the name Qwen3's and DeepSeek's read).
KEY = "reasoning_content"
# The empty block that turns thinking off where the template has no switch of its own.
EMPTY_BLOCK = f"{OPEN}\n\n{CLOSE}\n\n"
# The share of the reply's token limit each OpenAI effort level may spend reasoning ("none": off).
EFFORT_SHARE = {"minimal": 0.125, "low": 0.25, "medium": 0.5, "high": 0.75, "xhigh": 0.875}


def enabled(setting: str, chat_template: str | None) -> bool:
    """Whether a job's model reasons: `think` or `none` as set, `auto` when its template handles `<think>`."""
    if setting not in SETTINGS:
        raise ValueError(f"policy.reasoning: {setting!r} is not one of {SETTINGS}")
    if setting != "auto":
        return setting == "think"
    return any(mark in (chat_template or "") for mark in TEMPLATE_MARKS)


def opens_block(prompt_text: str) -> bool:
    """Whether the prompt ends inside a thinking block (a generation prompt that opens it, as DeepSeek R1's)."""
    return unclosed_thinking(prompt_text)


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a completion: reasoning is None when the text opens no thinking block."""
    body = text.lstrip()
    if not opened:
        if not body.startswith(OPEN):
            return None, text
        body = body[len(OPEN) :]
    reasoning, closed, content = body.partition(CLOSE)
    return reasoning.strip(), content.lstrip() if closed else ""


def signature(thinking: str) -> str:
    """An Anthropic thinking block's signature: a digest of its text (opaque to clients, never trusted back)."""
    return "dockyard:" + hashlib.blake2b(thinking.encode(), digest_size=16).hexdigest()


def count(pieces: list[str], opened: bool = False) -> int:
    """How many of a completion's tokens (decoded one by one) are its thinking block, closing tag included."""
    text = OPEN if opened else ""
    for k, piece in enumerate(pieces):
        text += piece
        if CLOSE in text:
            return k + 1
    return len(pieces)


def closed(text: str, opened: bool = False) -> bool:
    """Whether a completion (its prompt's block `opened`) has no thinking block left open."""
    return not unclosed_thinking((OPEN if opened else "") + text)


def without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages modulo reasoning: what history is matched and continued on (sessions.py)."""
    return [{k: v for k, v in m.items() if k != KEY} if KEY in m else m for m in messages]


def no_thinking(render, prompt: str, has_switch: bool) -> str:
    """What to write after the generation prompt `prompt` so the model answers without thinking: the
    template's own `enable_thinking=False` difference when it has that switch, else an empty block (only
    the closing when the prompt already opened one). `render(**switches)` renders the same prompt."""
    if has_switch:
        off = render(enable_thinking=False)
        if off.startswith(prompt) and len(off) > len(prompt):
            return off[len(prompt) :]
    return f"{CLOSE}\n\n" if opens_block(prompt) else EMPTY_BLOCK


@dataclass(frozen=True)
class Thinking:
    """What a request asked of the model's reasoning: as it was trained (default), off, or at most `budget` tokens."""

    off: bool = False
    budget: int | None = None
    share: float | None = None  # an effort level's: the budget is this share of the reply's token limit
    field: str = ""  # the request field that asked, for errors

    def tokens(self, max_tokens: int) -> int | None:
        """The reasoning budget in sampled tokens for a reply of at most `max_tokens`; None: no budget."""
        if self.share is not None:
            return max(1, int(max_tokens * self.share))
        return self.budget

    def check(self, reasons: bool) -> None:
        """BadRequest when a budget is asked of a model that does not reason (thinking off asks nothing of it)."""
        if (self.budget is not None or self.share is not None) and not reasons:
            raise BadRequest(
                f"{self.field}: the model does not reason (its chat template handles no <think> block and the "
                "job does not set policy.reasoning: think), so there is no reasoning to budget"
            )


def anthropic_thinking(value: dict[str, Any] | None, max_tokens: int) -> Thinking:
    """Anthropic's `thinking`: {"type": "disabled"} or {"type": "enabled", "budget_tokens": N}, N < max_tokens."""
    if value is None:
        return Thinking()
    kind = value.get("type")
    given = {k for k, v in value.items() if v is not None}  # null asks for nothing
    extra = sorted(given - {"type", *(("budget_tokens",) if kind == "enabled" else ())})
    if extra:
        raise BadRequest(f"thinking.{extra[0]}: not a field of a {kind!r} thinking setting")
    if kind == "disabled":
        return Thinking(off=True, field="thinking")
    if kind != "enabled":
        raise BadRequest(f"thinking.type: {kind!r} is not supported (send 'enabled' with budget_tokens, or 'disabled')")
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < max_tokens:
        raise BadRequest(
            f"thinking.budget_tokens: an integer from 1 to max_tokens - 1 ({max_tokens - 1}), not {budget!r}: "
            "the answer needs room after the reasoning"
        )
    return Thinking(budget=budget, field="thinking.budget_tokens")


def effort_thinking(effort: str | None, field: str) -> Thinking:
    """OpenAI's effort levels: `none` is thinking off, the others a share of the reply's token limit (EFFORT_SHARE)."""
    if effort is None:
        return Thinking()
    if effort == "none":
        return Thinking(off=True, field=field)
    if effort not in EFFORT_SHARE:
        raise BadRequest(f"{field}: {effort!r} is not one of {['none', *EFFORT_SHARE]}")
    return Thinking(share=EFFORT_SHARE[effort], field=field)
