"""The session recorder: recorded tokens are the next prompt's prefix; edited history splits a segment."""

from __future__ import annotations

import pytest

from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.rendering import Renderer, bridge
from services.endpoint.sessions import Sampled, SessionLimit, SessionStore

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(build_char_tokenizer())


def sample(renderer: Renderer, text: str, message: dict | None = None, eos: bool = True) -> Sampled:
    ids = renderer.encode(text) + ([renderer.eos_token_id] if eos else [])
    logprobs = [-0.5 - i for i in range(len(ids))]
    message = message or {"role": "assistant", "content": text}
    return Sampled(ids, logprobs, renderer.decode(ids), "eos", message)


def turn(session, renderer, messages, reply, tools=None, version=3):
    plan = session.plan(renderer, messages, tools)
    session.record(plan, [reply], version, [version])
    return plan


def test_second_turn_reuses_recorded_ids_and_tokenizes_only_the_new_messages(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("a")
    first = [{"role": "user", "content": "hi"}]
    # The model writes something the template would render differently (two spaces): kept as sampled.
    reply = sample(renderer, "x  =1")
    plan1 = turn(session, renderer, first, reply)
    assert renderer.decode(plan1.prompt_ids) == "user: hi\nassistant: "
    second = [*first, {"role": "assistant", "content": "x  =1"}, {"role": "user", "content": "more"}]
    plan2 = turn(session, renderer, second, sample(renderer, "y"), version=4)
    prefix = plan1.prompt_ids + reply.token_ids
    assert plan2.prompt_ids[: len(prefix)] == prefix
    assert plan2.new_segment is None
    assert renderer.decode(plan2.prompt_ids[len(prefix) :]) == "\nuser: more\nassistant: "
    traj = session.trajectory()
    assert len(traj["segments"]) == 1 and traj["splits"] == {}
    seg = traj["segments"][0]
    assert seg["token_ids"][: len(plan2.prompt_ids)] == plan2.prompt_ids
    sampled_positions = [i for i, m in enumerate(seg["loss_mask"]) if m]
    assert [seg["token_ids"][i] for i in sampled_positions] == reply.token_ids + sample(renderer, "y").token_ids
    assert [seg["logprobs"][i] for i in sampled_positions][: len(reply.logprobs)] == reply.logprobs
    assert {seg["weight_versions"][i] for i in sampled_positions} == {3, 4}
    assert all(seg["logprobs"][i] == 0.0 for i, m in enumerate(seg["loss_mask"]) if not m)


def test_edited_history_starts_a_new_segment_rendered_afresh(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("b")
    first = [{"role": "user", "content": "hi"}]
    turn(session, renderer, first, sample(renderer, "a"))
    rewritten = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "go"}]
    plan = turn(session, renderer, rewritten, sample(renderer, "c"))
    assert plan.new_segment == "history_changed"
    assert renderer.decode(plan.prompt_ids) == "user: hi\nassistant: b\nuser: go\nassistant: "
    traj = session.trajectory()
    assert [s["reason"] for s in traj["segments"]] == ["start", "history_changed"]
    assert traj["splits"] == {"history_changed": 1}


def test_truncated_history_and_changed_tools_split(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("c")
    first = [{"role": "user", "content": "hi"}]
    turn(session, renderer, first, sample(renderer, "a"))
    assert session.plan(renderer, [{"role": "user", "content": "new"}], None).new_segment == "history_changed"
    again = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "go"}]
    assert session.plan(renderer, again, TOOLS).new_segment == "history_changed"
    assert session.plan(renderer, again, None).new_segment is None


def test_tool_call_turn_continues_whatever_the_json_formatting(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("d")
    first = [{"role": "user", "content": "add 1 2"}]
    raw = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    reply = sample(renderer, raw, {"role": "assistant", "content": "", "tool_calls": [call]})
    plan1 = turn(session, renderer, first, reply, TOOLS)
    back = {**call, "id": "other-id", "function": {"name": "add", "arguments": {"b": 2, "a": 1}}}
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [back]}, {"role": "tool", "content": "3"}]
    plan2 = session.plan(renderer, second, TOOLS)
    assert plan2.new_segment is None
    assert plan2.prompt_ids[: len(plan1.prompt_ids) + len(reply.token_ids)] == plan1.prompt_ids + reply.token_ids
    assert renderer.decode(plan2.prompt_ids).endswith("</tool_call><eos>\ntool: 3\nassistant: ")


def test_n_choices_continue_with_the_one_sent_back(renderer: Renderer) -> None:
    session = SessionStore(4, 60, 10).open("e")
    first = [{"role": "user", "content": "hi"}]
    plan = session.plan(renderer, first, None)
    replies = [sample(renderer, "a"), sample(renderer, "b")]
    session.record(plan, replies, 1, [1])
    second = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "ok"}]
    plan2 = session.plan(renderer, second, None)
    assert plan2.chosen == 1 and plan2.prompt_ids[: len(plan.prompt_ids) + 2] == plan.prompt_ids + replies[1].token_ids


def test_store_bounds_sessions_turns_and_expires_idle_ones(renderer: Renderer) -> None:
    now = [0.0]
    store = SessionStore(2, 10, 1, clock=lambda: now[0])
    store.open("a")
    store.open("b")
    with pytest.raises(SessionLimit):
        store.open("c")
    now[0] = 11
    store.open("c")
    assert store.get("a") is None and len(store) == 1
    session = store.get("c")
    turn(session, renderer, [{"role": "user", "content": "hi"}], sample(renderer, "a"))
    with pytest.raises(SessionLimit, match="1 turns"):
        session.plan(renderer, [{"role": "user", "content": "x"}], None)
    assert store.delete("c") and not store.delete("c")


def test_bridge_skips_what_the_model_wrote_of_the_closing() -> None:
    assert bridge("hello<|im_end|>", "<|im_end|>\n") == "\n"
    assert bridge("hello<eos>", "\n") == "\n"
    assert bridge("hello\n", "\n") == ""
