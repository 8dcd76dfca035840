"""Tool-call parsing: well-formed Hermes calls become structured; anything else stays text."""

from __future__ import annotations

from services.endpoint.tool_parsers import parse, parse_hermes, pick_parser

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_hermes_call_is_structured_and_text_around_it_is_content() -> None:
    parsed = parse_hermes('sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', TOOLS)
    assert parsed.content == "sure"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [("add", {"a": 1})]
    assert parsed.tool_calls[0]["id"].startswith("call_")


def test_two_calls() -> None:
    one = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    text = one + '<tool_call>{"name": "add", "arguments": {"b": 2}}</tool_call>'
    assert len(parse_hermes(text, TOOLS).tool_calls) == 2


def test_malformed_or_unknown_calls_stay_text() -> None:
    for text in (
        '<tool_call>{"name": "add", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "add", "arguments": "x"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}',  # unclosed
        '<tool_call>["add"]</tool_call>',
    ):
        parsed = parse_hermes(text, TOOLS)
        assert parsed.content == text and parsed.tool_calls == []


def test_no_tools_means_text_and_parser_choice() -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse("hermes", text, None).tool_calls == []
    assert parse("none", text, TOOLS).tool_calls == []

    class WithSchema:
        response_template = {"type": "object"}

    assert pick_parser("auto", WithSchema()) == "transformers"
    assert pick_parser("auto", object()) == "hermes"
    assert pick_parser("none", WithSchema()) == "none"


def test_transformers_parser_failure_is_text() -> None:
    class Broken:
        def parse_response(self, *args, **kwargs):
            raise RuntimeError("schema does not match")

    text = "<tool_call>oops"
    parsed = parse("transformers", text, TOOLS, Broken(), "")
    assert parsed.content == text and parsed.tool_calls == []
