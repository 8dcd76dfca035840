"""Tool calls out of model output, in the chat template's format.

    completion text ──parse(parser, text, tools)──> Parsed(content, tool_calls)

Parsers, chosen by DOCKYARD_ENDPOINT_TOOL_PARSER or detected (`pick_parser`):
- `transformers`: the tokenizer's own `response_template` through
  `tokenizer.parse_response` (transformers >= 5), used when the tokenizer has one;
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (Hermes, Qwen 2.5/3, the built-in character tokenizer);
- `none`: text only.

Guarantees: a call is returned as structured only when every block parses as
a JSON object with a string `name` of one of the request's tools and object
`arguments`; anything else (malformed JSON, an unknown tool, an unclosed block,
a parser error) returns the whole text as content with no calls and
`malformed` set (what grpo.invalid_action_penalty penalizes), never raises.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

PARSERS = ("auto", "transformers", "hermes", "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class Parsed:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False  # the text tried a tool call that did not parse


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


def _names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or () if "function" in t}


def parse_hermes(text: str, tools: list[dict] | None) -> Parsed:
    if "<tool_call>" not in text:
        return Parsed(text)
    names = _names(tools)
    blocks = list(_HERMES.finditer(text))
    if not blocks or text.count("<tool_call>") != len(blocks):
        return Parsed(text, malformed=True)
    calls = []
    for block in blocks:
        try:
            value = json.loads(block.group(1))
        except ValueError:
            return Parsed(text, malformed=True)
        if not isinstance(value, dict) or value.get("name") not in names:
            return Parsed(text, malformed=True)
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return Parsed(text, malformed=True)
        calls.append(_tool_call(value["name"], arguments))
    return Parsed(_HERMES.sub("", text).strip(), calls)


def parse_transformers(tokenizer: PreTrainedTokenizerBase, text: str, prefix: str, tools: list[dict] | None) -> Parsed:
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
        names = _names(tools)
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if function.get("name") not in names or not isinstance(arguments, dict):
                return Parsed(text, malformed=True)
            calls.append(_tool_call(function["name"], arguments))
        return Parsed(message.get("content") or "", calls)
    except Exception:  # a response the schema does not describe is text, whatever the parser raised
        # Not flagged malformed: some schemas raise on plain text, which is no attempted call.
        return Parsed(text)


def parse(
    parser: str, text: str, tools: list[dict] | None, tokenizer: PreTrainedTokenizerBase | None = None, prefix: str = ""
) -> Parsed:
    if not tools or parser == "none":
        return Parsed(text)
    if parser == "transformers" and tokenizer is not None:
        return parse_transformers(tokenizer, text, prefix, tools)
    return parse_hermes(text, tools)
