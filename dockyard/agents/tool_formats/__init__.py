"""Tool-call formats by model family: one registry that the endpoint, preflight and tests share.

    job config policy.tool_call_format ──pick(setting, tokenizer)──> format name
        auto: the tokenizer's response_template ─> transformers
              else the chat template's features  ─> detect (harmony, deepseek_v3, mistral, qwen3_coder,
                                                   llama3_json, hermes: the first whose feature it renders)
              else                               ─> hermes (FALLBACK)
    completion ids ──visible_text(name, tokenizer, ids)──> text (special tokens dropped, the format's kept)
        ──parse(name, text, tools)──> Parsed(content, tool_calls, malformed, error)

Formats: `hermes`, `qwen3_coder`, `llama3_json`, `mistral`, `deepseek_v3`, `harmony` (one module
each, with the features its templates render, the marker tokens its calls are written with, and an
example), `transformers` (the tokenizer's response_template) and `none` (text only).

Guarantees (every format): a call is structured only when it is a valid call of the request's tools
by `dockyard.agents.tool_calls.ToolRules`; a text that tries a call and gets anything wrong (bad
JSON, an unknown tool, misnamed keys, an unclosed block, a schema violation, one bad call among good
ones) is returned whole as content with no calls, `malformed` set (an invalid action) and `error`
saying why; a call is never repaired or invented, a text without an attempted call is content and
not malformed, and with no tools every text is content. `parse` never raises; `pick` refuses a
setting that names no format.
"""

from __future__ import annotations

import weakref
from typing import Any

from dockyard.agents.tool_calls import ToolRules
from dockyard.agents.tool_formats import (
    deepseek_v3,
    harmony,
    hermes,
    llama3_json,
    mistral,
    qwen3_coder,
    response_template,
)
from dockyard.agents.tool_formats.base import Invalid, Parsed, call_id, invalid

__all__ = [
    "FALLBACK",
    "FORMATS",
    "SETTINGS",
    "Parsed",
    "call_id",
    "call_markers",
    "detect",
    "parse",
    "pick",
    "renders",
    "template_of",
    "visible_text",
]

# Detection order: a more specific feature first (Qwen3-Coder's templates also render <tool_call>).
FORMATS = {m.NAME: m for m in (harmony, deepseek_v3, mistral, qwen3_coder, llama3_json, hermes)}
SETTINGS = ("auto", *FORMATS, "transformers", "none")
FALLBACK = "hermes"


def template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template text (all named templates of a dict), or ""."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def renders(name: str, tokenizer: Any) -> bool:
    """Whether the tokenizer can write this format: its chat template renders the format's features
    (a response_template for `transformers`; `none` always)."""
    if name == "none":
        return True
    if name == "transformers":
        return getattr(tokenizer, "response_template", None) is not None
    module = FORMATS[name]
    template = template_of(tokenizer)
    if hasattr(module, "renders"):
        return module.renders(template)
    return any(feature in template for feature in module.FEATURES)


def detect(tokenizer: Any) -> str | None:
    """The first format (in FORMATS' order) whose features the chat template renders, or None."""
    return next((name for name in FORMATS if renders(name, tokenizer)), None)


def pick(setting: str, tokenizer: Any) -> tuple[str, str]:
    """The format a job uses and how it was chosen: "set", "response_template", "detected" or "fallback"."""
    if setting not in SETTINGS:
        raise ValueError(f"tool_call_format {setting!r} is none of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting, "set"
    if getattr(tokenizer, "response_template", None) is not None:
        return "transformers", "response_template"
    found = detect(tokenizer)
    return (found, "detected") if found else (FALLBACK, "fallback")


_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {format: (special, kept)}


def _special_ids(name: str, tokenizer: Any) -> tuple[frozenset[int], frozenset[int]]:
    """(the tokenizer's special ids, those of them the format keeps), computed once per tokenizer and format:
    a streamed reply decodes on every token."""
    cache = _SPECIAL_IDS.setdefault(tokenizer, {})
    if name not in cache:
        markers = set(getattr(FORMATS.get(name), "MARKERS", ()))
        special = frozenset(tokenizer.all_special_ids) | {
            i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)
        }
        cache[name] = special, frozenset(i for i in special if tokenizer.convert_ids_to_tokens(i) in markers)
    return cache[name]


def visible_text(name: str, tokenizer: Any, ids: list[int]) -> str:
    """The completion's text with special tokens dropped, except those the format writes its calls with
    (Mistral's [TOOL_CALLS], harmony's <|call|>, ... are special tokens in their families' tokenizers)."""
    special, kept = _special_ids(name, tokenizer)
    if not kept:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode([i for i in ids if i not in special or i in kept], skip_special_tokens=False)


def call_markers(name: str) -> tuple[str, ...] | None:
    """The texts from which a reply may be a tool call in format `name` (a streamed reply holds back from
    the first one on: services/endpoint/streaming.py); None when no text tells a call before the reply
    ends (`transformers`: the tokenizer's own schema decides)."""
    if name == "none":
        return ()
    if name == "transformers":
        return None
    module = FORMATS[name]
    return getattr(module, "OPENERS", module.MARKERS)


def parse(name: str, text: str, tools: list[dict] | None, tokenizer: Any | None = None, prefix: str = "") -> Parsed:
    """The text as content and tool calls in format `name` (module docstring: the guarantees)."""
    if not tools or name == "none":
        return Parsed(text)
    rules = ToolRules(tools)
    try:
        if name == "transformers":
            return response_template.parse(tokenizer, text, prefix, rules, tools)
        module = FORMATS[name]
        return module.parse(text, rules) if module.attempted(text) else Parsed(text)
    except Invalid as exc:
        return invalid(text, str(exc))
