"""Qwen3-Coder tool calls: XML-like blocks whose parameter values are typed by the tool's schema.

    <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>
        ──parse──> {"name": NAME, "arguments": {P: VALUE typed by parameters.properties.P}}

A value is the text between its tags less one newline on each side. It is a string when the
property's schema says `type: string` (or a list of types holding `string` first); any other typed
property takes the value as JSON (`true`/`false` also as `True`/`False`, which a template that
prints values with Jinja's `string` filter renders); a property without a type is JSON when it
parses, else the string. A value that does not match its type is left as the string, so the schema
check refuses it.

Guarantees: every `<tool_call>` closes; a block holds exactly one `<function=...>...</function>`
made only of `<parameter=...>...</parameter>` elements, each closed, no name twice; the call is a
valid call of the tools; the content is the text outside the blocks.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_call

NAME = "qwen3_coder"
FEATURES = ("<function=", "<parameter=")  # both rendered
MARKERS = ("<tool_call>", "</tool_call>")
EXAMPLE = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_BOOLEANS = {"True": True, "False": False}


def attempted(text: str) -> bool:
    return "<tool_call>" in text or "<function=" in text


def renders(template: str) -> bool:
    return all(feature in template for feature in FEATURES)


def _types(schema: dict[str, Any], name: str) -> list[str]:
    prop = (schema.get("properties") or {}).get(name)
    kind = prop.get("type") if isinstance(prop, dict) else None
    return [kind] if isinstance(kind, str) else list(kind or [])


def _typed(raw: str, types: list[str]) -> Any:
    if types and types[0] == "string":
        return raw
    if raw in _BOOLEANS and "boolean" in types:
        return _BOOLEANS[raw]
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # not its type: the schema check says so


def _arguments(body: str, schema: dict[str, Any]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    at = 0
    while at < len(body) and body[at:].strip():
        match = _PARAMETER.match(body, at)
        if match is None:
            opened = re.match(r"\s*<parameter=([^>\n]+)>", body[at:])
            if opened:
                raise Invalid(f"the <parameter={opened.group(1)}> element is not closed")
            raise Invalid(f"a <function=...> holds something that is no <parameter=...>: {body[at:][:40]!r}")
        name, raw = match.group(1).strip(), match.group(2)
        if "<parameter=" in raw:
            raise Invalid(f"the <parameter={name}> element is not closed")
        if name in arguments:
            raise Invalid(f"the parameter {name!r} is given twice")
        raw = raw.removeprefix("\n").removesuffix("\n")
        arguments[name] = _typed(raw, _types(schema, name))
        at = match.end()
    return arguments


def parse(text: str, rules: ToolRules) -> Parsed:
    blocks = list(_BLOCK.finditer(text))
    if text.count("<tool_call>") != len(blocks):
        raise Invalid("a <tool_call> block is not closed")
    outside = _BLOCK.sub("", text)
    if "<function=" in outside:
        raise Invalid("a <function=...> call is outside a <tool_call> block")
    calls = []
    for block in blocks:
        match = _FUNCTION.fullmatch(block.group(1))
        if match is None or "<function=" in match.group(2):
            raise Invalid("a <tool_call> block must hold exactly one closed <function=NAME>...</function>")
        name = match.group(1).strip()
        schema = rules.schemas.get(name)
        if schema is None:
            raise Invalid(f"no tool {name!r}; the tools are {', '.join(rules.schemas) or 'none'}")
        calls.append(checked_call(rules, name, _arguments(match.group(2), schema)))
    return Parsed(outside.strip(), calls)
