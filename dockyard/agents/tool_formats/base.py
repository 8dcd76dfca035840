"""What every tool-call format shares: the parse result and the two ways a parse ends.

    model text ──a format's parse(text, rules)──> Parsed(content, tool_calls) | invalid(text, why)

Guarantees: `invalid` keeps the whole text as content with no calls (an invalid action, never a
repaired call); `tool_call` gives each call a fresh id in the OpenAI shape, arguments as parsed.
`json_at` reads exactly one JSON value where the text says one starts, or says why not.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.tool_calls import ToolRules

_DECODER = json.JSONDecoder()


@dataclass
class Parsed:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False  # the text tried a tool call that is not a valid call (an invalid action)
    error: str = ""  # why, when malformed


class Invalid(ValueError):
    """Raised inside a parser at the first thing that makes the text no valid call; `parse` turns it
    into the whole text as content, malformed."""


def invalid(text: str, error: str) -> Parsed:
    return Parsed(text, malformed=True, error=error)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: dict) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def json_at(text: str, start: int, what: str) -> tuple[Any, int]:
    """The JSON value that starts at `start` (after whitespace) and the index just past it; Invalid if none."""
    while start < len(text) and text[start].isspace():
        start += 1
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError as exc:
        raise Invalid(f"{what}: not JSON: {exc}") from None


def checked_call(rules: ToolRules, name: Any, arguments: Any) -> dict[str, Any]:
    """The structured call of `name(arguments)`; Invalid unless it is a valid call of the tools."""
    if not isinstance(name, str):
        raise Invalid("the tool call has no string `name`")
    if error := rules.arguments_error(name, arguments):
        raise Invalid(error)
    return tool_call(name, arguments)


def checked_object(rules: ToolRules, value: Any) -> dict[str, Any]:
    """The structured call of a `{"name": ..., "arguments": {...}}` object (those keys only); Invalid if not."""
    if error := rules.call_error(value):
        raise Invalid(error)
    return tool_call(value["name"], value["arguments"])
