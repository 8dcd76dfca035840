"""Tool-call parsing: well-formed Hermes calls become structured; anything else stays text."""

from __future__ import annotations

import pytest

from dockyard.agents.tool_formats import parse, pick

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_hermes_call_is_structured_and_text_around_it_is_content() -> None:
    parsed = parse("hermes", 'sure <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', TOOLS)
    assert parsed.content == "sure"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [("add", {"a": 1})]
    assert parsed.tool_calls[0]["id"].startswith("call_")


def test_two_calls() -> None:
    one = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    text = one + '<tool_call>{"name": "add", "arguments": {"b": 2}}</tool_call>'
    assert len(parse("hermes", text, TOOLS).tool_calls) == 2


def test_malformed_or_unknown_calls_stay_text() -> None:
    for text in (
        '<tool_call>{"name": "add", "arguments": {</tool_call>',  # bad JSON
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "add", "arguments": "x"}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}',  # unclosed
        '<tool_call>["add"]</tool_call>',
    ):
        parsed = parse("hermes", text, TOOLS)
        assert parsed.content == text and parsed.tool_calls == []


def test_no_tools_means_text_and_parser_choice() -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert parse("hermes", text, None).tool_calls == []
    assert parse("none", text, TOOLS).tool_calls == []

    class WithSchema:
        response_template = {"type": "object"}

    assert pick("auto", WithSchema()) == ("transformers", "response_template")
    assert pick("auto", object()) == ("hermes", "fallback")
    assert pick("none", WithSchema()) == ("none", "set")


def test_transformers_parser_failure_is_text() -> None:
    class Broken:
        def parse_response(self, *args, **kwargs):
            raise RuntimeError("schema does not match")

    text = "<tool_call>oops"
    parsed = parse("transformers", text, TOOLS, Broken(), "")
    assert parsed.content == text and parsed.tool_calls == []


STRICT = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"name": "sub", "arguments": {"a": 1}}', "no tool 'sub'; the tools are add"),
        ('{"name": "add"}', "the call of 'add' has no `arguments`"),
        ('{"name": "add", "ahguments": {"a": 1}}', "it has 'ahguments'"),
        ('{"arguments": {"a": 1}}', "no string `name`"),
        ('{"name": "add", "arguments": "{\\"a\\": 1}"}', "must be a JSON object, not str"),
        ('{"name": "add", "arguments": {"a": "1"}}', "the arguments.a of add: '1' is not of type 'integer'"),
        ('{"name": "add", "arguments": {}}', "'a' is a required property"),
        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "('b' was unexpected)"),
    ],
)
def test_a_call_that_is_not_valid_for_the_tools_is_an_invalid_action_never_repaired(body: str, says: str) -> None:
    text = f"let me add <tool_call>{body}</tool_call>"
    parsed = parse("hermes", text, STRICT)
    assert (parsed.content, parsed.tool_calls, parsed.malformed) == (text, [], True)
    assert says in parsed.error


def test_a_valid_call_is_unchanged_by_the_strict_rule() -> None:
    parsed = parse("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', STRICT)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [("add", {"a": 1})]
    assert (parsed.content, parsed.malformed, parsed.error) == ("", False, "")


class Responding:
    """A tokenizer whose response template parsed the text into `message`."""

    def __init__(self, message: dict) -> None:
        self.message = message

    def parse_response(self, *args, **kwargs) -> dict:
        return self.message


@pytest.mark.parametrize(
    ("function", "malformed"),
    [
        ({"name": "add", "arguments": {"a": 1}}, False),
        ({"name": "add", "arguments": '{"a": 1}'}, False),  # a template that keeps the arguments as JSON text
        ({"name": "add", "ahguments": {"a": 1}}, True),
        ({"name": "add"}, True),
        ({"name": "add", "arguments": "{a: 1"}, True),
        ({"name": "add", "arguments": {"a": 1.5}}, True),
        ({"name": "rm", "arguments": {}}, True),
    ],
)
def test_the_transformers_parser_applies_the_same_rule(function: dict, malformed: bool) -> None:
    tokenizer = Responding({"content": "", "tool_calls": [{"type": "function", "function": function}]})
    parsed = parse("transformers", "the text", STRICT, tokenizer, "")
    assert parsed.malformed is malformed
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ([] if malformed else [{"a": 1}])
    assert parsed.content == ("the text" if malformed else "")
