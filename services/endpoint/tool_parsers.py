"""Tool calls out of model output, in the chat template's format.

    completion text ──parse(parser, text, tools)──> Parsed(content, tool_calls)

Parsers, chosen by DOCKYARD_ENDPOINT_TOOL_PARSER or detected (`pick_parser`):
- `transformers`: the tokenizer's own `response_template` through
  `tokenizer.parse_response` (transformers >= 5), used when the tokenizer has one;
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Hermes, Qwen 2.5/3, the built-in character tokenizer);
- `none`: text only.

Guarantees: a call is returned as structured only when every block parses as
JSON and is a valid call of the request's tools by `dockyard.agents.tool_calls.ToolRules` (the keys
`name` and `arguments` only, a tool's name, arguments a JSON object valid for its schema); anything
else (malformed JSON, an unknown tool, a misnamed or missing key, arguments that are not an object or
break the schema, an unclosed block) returns the whole text as content with no calls, `malformed` set
(an invalid action: what grpo.invalid_action_penalty penalizes) and `error` saying why; a call is
never repaired. Never raises; a `transformers` parser error on text is plain text (no attempted call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from dockyard.agents.tool_calls import ToolRules

PARSERS = ("auto", "transformers", "hermes", "none")
# The text that opens a call, per format: a streamed reply holds back what may be one (streaming.py).
CALL_MARKERS = {"hermes": ("<tool_call>",), "none": ()}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class Parsed:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False  # the text tried a tool call that is not a valid call (an invalid action)
    error: str = ""  # why, when malformed


def _invalid(text: str, error: str) -> Parsed:
    return Parsed(text, malformed=True, error=error)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(name: str, arguments: dict) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def pick_parser(setting: str, tokenizer: PreTrainedTokenizerBase) -> str:
    if setting != "auto":
        return setting
    if getattr(tokenizer, "response_template", None) is not None:
        return "transformers"
    return "hermes"


def call_markers(parser: str) -> tuple[str, ...] | None:
    """The texts that open a tool call in `parser`'s format; None when a call cannot be told from the text
    before it (`transformers`: the tokenizer's own schema decides), so nothing may be shown before the end."""
    return CALL_MARKERS.get(parser)


def parse_hermes(text: str, tools: list[dict] | None) -> Parsed:
    if "<tool_call>" not in text:
        return Parsed(text)
    rules = ToolRules(tools)
    blocks = list(_HERMES.finditer(text))
    if not blocks or text.count("<tool_call>") != len(blocks):
        return _invalid(text, "a <tool_call> block is not closed")
    calls = []
    for block in blocks:
        try:
            value = json.loads(block.group(1))
        except ValueError as exc:
            return _invalid(text, f"a tool call is not JSON: {exc}")
        if error := rules.call_error(value):
            return _invalid(text, error)
        calls.append(_tool_call(value["name"], value["arguments"]))
    return Parsed(_HERMES.sub("", text).strip(), calls)


def parse_transformers(tokenizer: PreTrainedTokenizerBase, text: str, prefix: str, tools: list[dict] | None) -> Parsed:
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except Exception:  # a response the schema does not describe is text, whatever the parser raised
        # Not flagged malformed: some schemas raise on plain text, which is no attempted call.
        return Parsed(text)
    rules = ToolRules(tools)
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else call
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:  # a template whose response schema leaves the arguments as JSON text
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError as exc:
                return _invalid(text, f"the arguments of a tool call are not JSON: {exc}")
        if error := rules.call_error(function):
            return _invalid(text, error)
        calls.append(_tool_call(function["name"], function["arguments"]))
    return Parsed(message.get("content") or "", calls)


def parse(
    parser: str, text: str, tools: list[dict] | None, tokenizer: PreTrainedTokenizerBase | None = None, prefix: str = ""
) -> Parsed:
    if not tools or parser == "none":
        return Parsed(text)
    if parser == "transformers" and tokenizer is not None:
        return parse_transformers(tokenizer, text, prefix, tools)
    return parse_hermes(text, tools)
