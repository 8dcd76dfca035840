"""DeepSeek V3 tool calls: a block of calls between DeepSeek's full-width special tokens.

    content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"x": 1}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>                      ──parse──> content + calls

The V3.1 form `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜>` is read too.

Guarantees: the calls come last: one block that closes, holding only closed calls, each a valid
call of the tools, and nothing after it; the content is the text before the block.
"""

from __future__ import annotations

import re

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_call, json_at

NAME = "deepseek_v3"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FEATURES = (CALLS_BEGIN,)
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
EXAMPLE = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}add\n```json\n{{"a": 1}}\n```{CALL_END}{CALLS_END}'
_V3 = re.compile(r"function" + re.escape(SEP) + r"([^\n]+)\n```json\n(.*)\n```", re.DOTALL)
_V31 = re.compile(r"([^\n]+?)" + re.escape(SEP) + r"(.*)", re.DOTALL)


def attempted(text: str) -> bool:
    return any(marker in text for marker in MARKERS)


def _call(body: str, rules: ToolRules) -> dict:
    body = body.strip()
    match = _V3.fullmatch(body) if body.startswith("function" + SEP) else _V31.fullmatch(body)
    if match is None:
        raise Invalid(f"a tool call is not function{SEP}NAME and a ```json block: {body[:60]!r}")
    name = match.group(1).strip()
    arguments, end = json_at(match.group(2), 0, f"the arguments of {name}")
    if match.group(2)[end:].strip():
        raise Invalid(f"the arguments of {name} have text after their JSON object")
    return checked_call(rules, name, arguments)


def parse(text: str, rules: ToolRules) -> Parsed:
    start = text.find(CALLS_BEGIN)
    if start < 0 or text.count(CALLS_BEGIN) != 1:
        raise Invalid(f"tool calls must be one {CALLS_BEGIN} block")
    end = text.find(CALLS_END, start)
    if end < 0:
        raise Invalid(f"the {CALLS_BEGIN} block is not closed")
    if text[end + len(CALLS_END) :].strip():
        raise Invalid(f"text after the tool calls: {text[end + len(CALLS_END) :].strip()[:40]!r}")
    inside = text[start + len(CALLS_BEGIN) : end]
    calls = []
    for piece in inside.split(CALL_BEGIN)[1:] if inside.strip().startswith(CALL_BEGIN) else [None]:
        if piece is None or not piece.rstrip().endswith(CALL_END) or piece.count(CALL_END) != 1:
            raise Invalid(f"a tool call in the block is not {CALL_BEGIN}...{CALL_END}")
        calls.append(_call(piece.rstrip().removesuffix(CALL_END), rules))
    return Parsed(text[:start].strip(), calls)
