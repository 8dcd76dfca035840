"""Llama 3.x JSON tool calls: the whole message is the call(s), optionally after `<|python_tag|>`.

    [<|python_tag|>]{"name": "f", "parameters": {"x": 1}}[; {"name": "g", "parameters": {}}]
        ──parse──> calls, no content

A message is an attempted call when it holds `<|python_tag|>` or, past leading whitespace, starts
with a JSON object whose first key is `name`; any other text is content. Several calls are separated by
`;` (how the templates join them).

Guarantees: an attempted call is the whole message: JSON objects of exactly `name` and `parameters`
(the Llama templates' key), each a valid call of the tools, and nothing else; else it is malformed.
"""

from __future__ import annotations

import re

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_call, json_at

NAME = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
# The Llama 3.1+ templates' instruction for JSON calls, or the python tag they render before a call.
FEATURES = (PYTHON_TAG, '"parameters": dictionary of argument name')
MARKERS = (PYTHON_TAG,)
# A call is the whole message, so any JSON object may begin one: a streamed reply holds back from "{".
OPENERS = (PYTHON_TAG, "{")
EXAMPLE = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'
_STARTS = re.compile(r"\s*(<\|python_tag\|>|\{\s*\"name\")")
KEYS = ("name", "parameters")


def attempted(text: str) -> bool:
    return _STARTS.match(text) is not None or PYTHON_TAG in text


def parse(text: str, rules: ToolRules) -> Parsed:
    if PYTHON_TAG in text and not text.lstrip().startswith(PYTHON_TAG):
        raise Invalid(f"text before {PYTHON_TAG}: a tool call is the whole message")
    at = text.index(PYTHON_TAG) + len(PYTHON_TAG) if PYTHON_TAG in text else 0
    calls = []
    while True:
        value, at = json_at(text, at, "a tool call")
        if not isinstance(value, dict) or set(value) != set(KEYS):
            shown = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise Invalid(f"a tool call is a JSON object of exactly {' and '.join(KEYS)}, not {shown}")
        calls.append(checked_call(rules, value["name"], value["parameters"]))
        rest = text[at:].lstrip()
        if not rest:
            return Parsed("", calls)
        if not rest.startswith(";"):
            raise Invalid(f"text after a tool call: {rest[:40]!r} (the whole message must be calls)")
        at = len(text) - len(rest) + 1
