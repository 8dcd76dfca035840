"""Hermes tool calls (Hermes, Qwen 2.5/3, the built-in character tokenizer).

    text ... <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> ... ──parse──> content + calls

Guarantees: every `<tool_call>` opens a block that closes; each block is one JSON object of exactly
`name` and `arguments` that is a valid call of the tools; the content is the text outside the blocks.
"""

from __future__ import annotations

import re

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_object, json_at

NAME = "hermes"
FEATURES = ("<tool_call>",)
MARKERS = ("<tool_call>", "</tool_call>")
EXAMPLE = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def attempted(text: str) -> bool:
    return "<tool_call>" in text


def parse(text: str, rules: ToolRules) -> Parsed:
    blocks = list(_BLOCK.finditer(text))
    if text.count("<tool_call>") != len(blocks):
        raise Invalid("a <tool_call> block is not closed")
    calls = []
    for block in blocks:
        body = block.group(1)
        value, end = json_at(body, 0, "a tool call")
        if body[end:].strip():
            raise Invalid(f"a tool call has text after its JSON object: {body[end:].strip()[:40]!r}")
        calls.append(checked_object(rules, value))
    return Parsed(_BLOCK.sub("", text).strip(), calls)
