"""gpt-oss (harmony) tool calls: assistant messages addressed to `functions.NAME`.

    [<|start|>assistant]<|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"x": 1}<|call|>
        ──parse──> content (the other messages, as written) + calls

A completion is a run of messages, the first without its `<|start|>assistant` (the generation prompt
holds it); a message's header (before `<|message|>`) names its channel and, for a call, its
recipient `to=functions.NAME` (in the role part or after the channel, both of which the format
allows) and the content type (`<|constrain|>json` or `json`).

Guarantees: text with no harmony token is content, no call. Otherwise every message has a header and
ends (`<|end|>`, `<|return|>`, or `<|call|>` for a call); a message to `functions.NAME` is a call:
its body one JSON object, a valid call of the tools, ended by `<|call|>`; a message to any other
recipient is no call of the request's tools and so malformed. The content is the text of the
messages that are not calls, channels untouched (separating reasoning from the answer is not this
parser's work).
"""

from __future__ import annotations

import re

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats.base import Invalid, Parsed, checked_call, json_at

NAME = "harmony"
START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
FEATURES = (CONSTRAIN, "to=functions.")
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)
EXAMPLE = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>'
_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>|<\|start\|>|<\|end\|>|<\|call\|>).)*)<\|message\|>"
    r"(?P<body>(?:(?!<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>).)*)(?P<ending><\|end\|>|<\|call\|>|<\|return\|>|$)",
    re.DOTALL,
)
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


def attempted(text: str) -> bool:
    return any(marker in text for marker in MARKERS)


def parse(text: str, rules: ToolRules) -> Parsed:
    at, calls, content = 0, [], []
    stripped = text.rstrip()
    while at < len(stripped):
        match = _MESSAGE.match(stripped, at)
        if match is None or match.end() == at:
            raise Invalid(f"not a harmony message (header, {MESSAGE}, body, an end): {stripped[at:][:60]!r}")
        recipient = _RECIPIENT.search(match.group("header"))
        if recipient is None:  # only the last message may lack its end (a reply cut at max_tokens)
            content.append(match.group(0))
        else:
            to = recipient.group(1)
            if not to.startswith("functions."):
                raise Invalid(f"a message to {to!r}: the tools are functions.{', functions.'.join(rules.schemas)}")
            if match.group("ending") != CALL:
                raise Invalid(f"the call of {to} does not end with {CALL}")
            body = match.group("body")
            arguments, end = json_at(body, 0, f"the arguments of {to}")
            if body[end:].strip():
                raise Invalid(f"the arguments of {to} have text after their JSON object")
            calls.append(checked_call(rules, to.removeprefix("functions."), arguments))
        at = match.end()
    return Parsed("".join(content).strip(), calls)
