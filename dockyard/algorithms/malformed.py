"""Malformed actions visible in a model's text: what grpo.invalid_action_penalty penalizes.

    model output text ─> unclosed_thinking ─> bool      (tool calls: dockyard/agents/tool_formats/
                                                           marks a call that is not a valid call of the
                                                           request's tools, by dockyard/agents/tool_calls.py,
                                                           as malformed)

Guarantees: pure functions of the text; no I/O, no state. A chat template that opens the thinking
block in the prompt (Qwen3's `<think>\\n` generation prompt) leaves a completion with a `</think>` and
no `<think>`: that is well formed.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def unclosed_thinking(text: str) -> bool:
    """True when the text opens a thinking block that it never closes (`<think>` after the last `</think>`)."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)
