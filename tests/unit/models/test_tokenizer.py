"""Character tokenizer: one token per character, survives save/load."""

from __future__ import annotations

from transformers import AutoTokenizer

from dockyard.models.tokenizer import CHARSET, build_char_tokenizer
from dockyard.tasks.expr import AGENT_TOOLS, make_tasks


def test_every_task_character_is_one_known_token():
    tok = build_char_tokenizer()
    for task in make_tasks("train", 100) + make_tasks("validation", 20):
        for text in (task.prompt, task.solution):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text


def test_specials_are_distinct_and_not_added_on_encode():
    tok = build_char_tokenizer()
    specials = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}
    assert len(specials) == 4 and None not in specials
    ids = tok("f(x)=x", add_special_tokens=True)["input_ids"]
    assert not specials & set(ids)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "f(x)=x"
    assert tok("\u00e9", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_round_trip_through_save_and_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "f(0)=-3 f(1)=10\nf(x)=  x%4+9 " + CHARSET
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert len(loaded) == len(tok)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name)
    batch = loaded(["x", "x+1"], padding=True)
    assert batch["input_ids"][0][1:] == [loaded.pad_token_id] * 2


def test_tools_render_as_one_compact_line_and_calls_as_hermes_json():
    tok = build_char_tokenizer()
    tools = [
        *AGENT_TOOLS,
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "pair", "parameters": {"properties": {"a": {}, "b": {}}}}},
    ]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 0}}}
    messages = [
        {"role": "user", "content": "find f(x)."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "f(0)=1"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == (
        "tools: f(x) add() pair(a,b)\n"
        "user: find f(x).\n"
        'assistant: <tool_call>{"name": "f", "arguments": {"x": 0}}</tool_call>\n'
        "tool: f(0)=1\n"
        "assistant: "
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    no_tools = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert no_tools == "user: find f(x).\nassistant: "
