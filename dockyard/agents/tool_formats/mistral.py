"""Mistral tool calls after the `[TOOL_CALLS]` token, in both of the family's forms.

    content[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, ...]         (list form, v3 tokenizers)
    content[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}                 (named form, v11+ tokenizers)
        ──parse──> content + calls

Guarantees: the calls come last: after the first `[TOOL_CALLS]` only calls follow (then nothing);
in the list form each item is an object of `name` and `arguments` (and the `id` the v3 templates
render, which is not kept: the endpoint gives each call its own id), in the named form a tool name,
`[ARGS]` and one JSON object; each is a valid call of the tools; the content is the text before.
"""

from __future__ import annotations

import re

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_call, checked_object, json_at

NAME = "mistral"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
FEATURES = (TOOL_CALLS,)
MARKERS = (TOOL_CALLS, ARGS)
EXAMPLE = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def attempted(text: str) -> bool:
    return TOOL_CALLS in text


def _listed(text: str, at: int, rules: ToolRules) -> tuple[list, int]:
    value, at = json_at(text, at, "the [TOOL_CALLS] list")
    if not isinstance(value, list) or not value:
        raise Invalid("[TOOL_CALLS] must be followed by a non-empty JSON list of calls")
    calls = []
    for item in value:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            item = {k: v for k, v in item.items() if k != "id"}  # the template's call id, not kept
        calls.append(checked_object(rules, item))
    return calls, at


def parse(text: str, rules: ToolRules) -> Parsed:
    start = text.index(TOOL_CALLS)
    at = start + len(TOOL_CALLS)
    if text[at:].lstrip().startswith("["):
        calls, at = _listed(text, at, rules)
        if text[at:].strip():
            raise Invalid(f"text after the [TOOL_CALLS] list: {text[at:].strip()[:40]!r}")
        return Parsed(text[:start].strip(), calls)
    calls = []
    while True:
        match = _NAMED.match(text, at)
        if match is None:
            raise Invalid("[TOOL_CALLS] must be followed by a JSON list or by NAME[ARGS]{...}")
        arguments, at = json_at(text, match.end(), f"the arguments of {match.group(1)}")
        calls.append(checked_call(rules, match.group(1), arguments))
        rest = text[at:].lstrip()
        if not rest:
            return Parsed(text[:start].strip(), calls)
        if not rest.startswith(TOOL_CALLS):
            raise Invalid(f"text after a tool call: {rest[:40]!r} (calls come last)")
        at = len(text) - len(rest) + len(TOOL_CALLS)
