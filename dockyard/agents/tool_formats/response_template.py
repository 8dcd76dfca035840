"""Tool calls through the tokenizer's own `response_template` (transformers >= 5 `parse_response`).

    text ──tokenizer.parse_response(text, prefix, tools)──> message ──each call judged──> content + calls

Guarantees: each call the schema finds is judged by the same rule as every format (arguments left as
JSON text by a schema are read as JSON first); a parse error on the text is plain text, not malformed
(some schemas raise on plain text, which is no attempted call).
"""

from __future__ import annotations

import json
from typing import Any

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_object

NAME = "transformers"


def parse(tokenizer: Any, text: str, prefix: str, rules: ToolRules, tools: list[dict] | None) -> Parsed:
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except Exception:  # a response the schema does not describe is text, whatever the parser raised
        return Parsed(text)
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else call
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:  # a template whose response schema leaves the arguments as JSON text
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError as exc:
                raise Invalid(f"the arguments of a tool call are not JSON: {exc}") from None
        calls.append(checked_object(rules, function))
    return Parsed(message.get("content") or "", calls)
