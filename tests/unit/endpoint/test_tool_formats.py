"""Tool-call formats by family: what each family's template writes is read back as the same calls, and
anything malformed is the whole text, an invalid action, never a repaired or partial call.

The tokenizers are character tokenizers with each family's template and special tokens
(tests/unit/endpoint/families.py); a completion is what the template renders for an assistant reply.
"""

from __future__ import annotations

from typing import get_args

import pytest

from dockyard.agents.tool_formats import FORMATS, SETTINGS, detect, parse, pick, renders, visible_text
from dockyard.config.policy import PolicyConfig
from dockyard.models.tokenizer import build_char_tokenizer
from tests.unit.endpoint.families import SPECIALS, TEMPLATES, completion, family_tokenizer

EDIT = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "force": {"type": "boolean"},
        "options": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["path"],
    "additionalProperties": False,
}
RUN = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "label": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "edit", "parameters": EDIT}},
    {"type": "function", "function": {"name": "run", "parameters": RUN}},
]
CALLS = [
    (
        "edit",
        {
            "path": 'src/"quoted" name.py',
            "count": 3,
            "ratio": -2.5,
            "force": True,
            "options": {"mode": {"deep": [1, {"x": None}], "on": False}, "note": 'line one\nline "two"'},
            "tags": ["A", "b c"],
        },
    ),
    ("run", {"command": 'echo "hi" \\\nls -la', "label": "123"}),  # a string that reads as a number
]
FORMAT = {family: family.removesuffix("_named") for family in TEMPLATES}  # mistral_named: the v11+ form
FAMILIES = list(TEMPLATES)


def reply(calls: list, content: str) -> dict:
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def read(calls: list[dict]) -> list[tuple]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_calls_the_template_renders_are_parsed_back_unchanged(family: str, count: int) -> None:
    tokenizer, name = family_tokenizer(family), FORMAT[family]
    content = "" if family == "llama3_json" else "Let me look."  # Llama's calls are the whole message
    text = completion(tokenizer, [{"role": "user", "content": "fix it"}], reply(CALLS[:count], content), TOOLS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids  # every character of the rendering is a token
    parsed = parse(name, visible_text(name, tokenizer, ids), TOOLS)
    assert (parsed.malformed, parsed.error) == (False, "")
    assert read(parsed.tool_calls) == CALLS[:count]
    if family == "harmony":  # its other messages stay as written (channels are not this parser's work)
        assert parsed.content == f"<|channel|>final<|message|>{content}<|end|>"
    else:
        assert parsed.content == content
    if family in SPECIALS and family != "llama3_json":  # (Llama's tag is optional)
        # The calls' tokens are special: decoding that skips them, as for other formats, loses the calls.
        assert parse(name, tokenizer.decode(ids, skip_special_tokens=True), TOOLS).tool_calls == []


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def qwen(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def llama(name: str, arguments: str, key: str = "parameters") -> str:
    return f'{{"name": "{name}", "{key}": {arguments}}}'


def mistral(*calls: str) -> str:
    return "[TOOL_CALLS][" + ", ".join(calls) + "]"


def listed(name: str, arguments: str, key: str = "arguments") -> str:
    return f'{{"name": "{name}", "{key}": {arguments}}}'


def deepseek(*calls: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>"


def ds_call(name: str, arguments: str, fence: str = "json") -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```{fence}\n{arguments}\n```<｜tool▁call▁end｜>"


def harmony(name: str, arguments: str, end: str = "<|call|>", to: str = "functions.") -> str:
    return f"<|channel|>commentary to={to}{name} <|constrain|>json<|message|>{arguments}{end}"


GOOD_ARGS = '{"command": "ls"}'
MALFORMED = {
    "hermes": {
        "unclosed": '<tool_call>{"name": "run", "arguments": {"command": "ls"}}',
        "bad JSON": hermes("run", '{"command": ls}'),
        "unknown tool": hermes("rm", "{}"),
        "misnamed key": '<tool_call>{"name": "run", "args": {"command": "ls"}}</tool_call>',
        "wrong type": hermes("run", '{"command": 5}'),
        "one good, one bad": hermes("run", GOOD_ARGS) + hermes("run", '{"command": "ls", "x": 1}'),
    },
    "qwen3_coder": {
        "unclosed": qwen("run", command="ls").removesuffix("</tool_call>"),
        "unclosed parameter": "<tool_call>\n<function=run>\n<parameter=command>\nls\n</function>\n</tool_call>",
        "bad JSON": qwen("edit", path="a", options='{"mode": '),  # an object parameter that is no JSON
        "unknown tool": qwen("rm", path="a"),
        "misnamed key": "<tool_call>\n<function=run>\n<param=command>\nls\n</param>\n</function>\n</tool_call>",
        "wrong type": qwen("edit", path="a", count="many"),
        "one good, one bad": qwen("run", command="ls") + qwen("run", command="ls", command2="x"),
        "a parameter twice": qwen("run", command="ls").replace(
            "</function>", "<parameter=command>\nx\n</parameter>\n</function>"
        ),
    },
    "llama3_json": {
        "unclosed": '<|python_tag|>{"name": "run", "parameters": {"command": "ls"}',
        "bad JSON": llama("run", "{command: 'ls'}"),
        "unknown tool": llama("rm", "{}"),
        "misnamed key": llama("run", GOOD_ARGS, key="arguments"),
        "wrong type": llama("run", '{"command": 5}'),
        "one good, one bad": llama("run", GOOD_ARGS) + "; " + llama("rm", "{}"),
        "text after the call": llama("run", GOOD_ARGS) + " and done",
    },
    "mistral": {
        "unclosed": "[TOOL_CALLS][" + listed("run", GOOD_ARGS),
        "bad JSON": mistral(listed("run", "{'command': 'ls'}")),
        "unknown tool": mistral(listed("rm", "{}")),
        "misnamed key": mistral(listed("run", GOOD_ARGS, key="args")),
        "wrong type": mistral(listed("run", '{"command": 5}')),
        "one good, one bad": mistral(listed("run", GOOD_ARGS), listed("run", '{"command": null}')),
        "named form, one good, one bad": "[TOOL_CALLS]run[ARGS]" + GOOD_ARGS + "[TOOL_CALLS]rm[ARGS]{}",
        "named form, bad JSON": '[TOOL_CALLS]run[ARGS]{"command": "ls"',
    },
    "deepseek_v3": {
        "unclosed": deepseek(ds_call("run", GOOD_ARGS)).removesuffix("<｜tool▁calls▁end｜>"),
        "bad JSON": deepseek(ds_call("run", '{"command": "ls",}')),
        "unknown tool": deepseek(ds_call("rm", "{}")),
        "misnamed key": deepseek(ds_call("run", GOOD_ARGS, fence="yaml")),
        "wrong type": deepseek(ds_call("run", '{"command": ["ls"]}')),
        "one good, one bad": deepseek(ds_call("run", GOOD_ARGS), ds_call("edit", '{"count": 1}')),
    },
    "harmony": {
        "unclosed": harmony("run", GOOD_ARGS, end=""),
        "bad JSON": harmony("run", '{"command": "ls"'),
        "unknown tool": harmony("rm", "{}"),
        "misnamed key": harmony("search", GOOD_ARGS, to="browser."),
        "wrong type": harmony("run", '{"command": false}'),
        "one good, one bad": harmony("run", GOOD_ARGS) + "<|start|>assistant" + harmony("run", "{}"),
    },
}
CASES = [(name, kind, text) for name, cases in MALFORMED.items() for kind, text in cases.items()]


@pytest.mark.parametrize(("name", "kind", "text"), CASES, ids=[f"{n}: {k}" for n, k, _ in CASES])
def test_a_malformed_call_is_the_whole_text_and_an_invalid_action(name: str, kind: str, text: str) -> None:
    text = "I will run it.\n" + text if name not in ("llama3_json", "harmony") else text
    parsed = parse(name, text, TOOLS)
    assert (parsed.content, parsed.tool_calls, parsed.malformed) == (text, [], True)
    assert parsed.error


@pytest.mark.parametrize("name", list(FORMATS))
def test_plain_text_is_content_and_no_invalid_action(name: str) -> None:
    for text in ("I am done: the answer is 4.", '{"answer": 4}', "Use [brackets] and <tags> freely."):
        assert parse(name, text, TOOLS) == parse("none", text, TOOLS)
        assert not parse(name, text, TOOLS).malformed
    if name == "harmony":  # a final answer in the harmony format is no call either
        final = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
        assert (parse(name, final, TOOLS).tool_calls, parse(name, final, TOOLS).malformed) == ([], False)


@pytest.mark.parametrize("name", list(FORMATS))
def test_without_tools_a_call_is_text(name: str) -> None:
    text = completion(family_tokenizer(name), [{"role": "user", "content": "go"}], reply(CALLS[1:], ""), TOOLS)
    parsed = parse(name, text, None)
    assert (parsed.content, parsed.tool_calls, parsed.malformed) == (text, [], False)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_detects_the_format_each_template_renders(family: str) -> None:
    tokenizer = family_tokenizer(family)
    assert detect(tokenizer) == FORMAT[family]
    assert pick("auto", tokenizer) == (FORMAT[family], "detected")
    assert [name for name in FORMATS if renders(name, tokenizer)] in ([FORMAT[family]], ["qwen3_coder", "hermes"])


def test_auto_falls_back_to_hermes_and_a_response_template_wins() -> None:
    assert pick("auto", build_char_tokenizer()) == ("hermes", "detected")  # the built-in template writes Hermes
    plain = build_char_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert (detect(plain), pick("auto", plain)) == (None, ("hermes", "fallback"))
    plain.response_template = {"type": "object"}
    assert pick("auto", plain) == ("transformers", "response_template")
    assert pick("mistral", plain) == ("mistral", "set")
    with pytest.raises(ValueError, match="tool_call_format 'mistral7'"):
        pick("mistral7", plain)


def test_the_config_setting_offers_exactly_the_registry() -> None:
    assert sorted(get_args(PolicyConfig.model_fields["tool_call_format"].annotation)) == sorted(SETTINGS)


def test_visible_text_keeps_the_format_tokens_and_drops_the_others() -> None:
    tokenizer = family_tokenizer("mistral")
    ids = tokenizer.encode('ok[TOOL_CALLS][{"name": "run", "arguments": {}}]<eos>', add_special_tokens=False)
    assert visible_text("mistral", tokenizer, ids) == 'ok[TOOL_CALLS][{"name": "run", "arguments": {}}]'
    assert visible_text("hermes", tokenizer, ids) == 'ok[{"name": "run", "arguments": {}}]'
