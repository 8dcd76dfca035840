"""A reasoning model behind the endpoint, through the official clients (strict response validation): its
`<think>` block comes back as each API's reasoning field, streamed and not; a conversation whose client
drops the reasoning (OpenAI) or sends it back (Anthropic thinking blocks, Responses reasoning items) stays
one recorded segment with the think tokens in the prompt; an unclosed block; thinking off and budgets.

The model is the scripted backend on a Qwen3-like template (tests/unit/endpoint/thinking_tokenizer.py),
which drops earlier turns' reasoning from its rendering, as Qwen3's does.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import openai
import pytest

from dockyard.agents.contract import SESSION_HEADER
from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint import reasoning
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.unit.endpoint.scripted import CALL, OA_TOOLS, TOKEN, ScriptedBackend
from tests.unit.endpoint.thinking_tokenizer import THINKING_TEMPLATE, build_thinking_tokenizer


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(build_thinking_tokenizer(), reasoning=True, limits=True)


@pytest.fixture
def app(backend):
    return create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)


def oa(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return openai.AsyncOpenAI(
        base_url="http://endpoint/v1", api_key=TOKEN, http_client=http, max_retries=0, _strict_response_validation=True
    )


def an(app) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://endpoint")
    return anthropic.AsyncAnthropic(
        base_url="http://endpoint", api_key=TOKEN, http_client=http, max_retries=0, _strict_response_validation=True
    )


async def trajectory(app, session: str) -> dict:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return (await http.get(f"/v1/sessions/{session}/trajectory", headers={"x-api-key": TOKEN})).json()


def text(backend: ScriptedBackend, ids: list[int]) -> str:
    return backend.model_.renderer.decode(ids)


def trained_text(backend: ScriptedBackend, segment: dict) -> str:
    ids = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    return text(backend, ids)


# --- the module's rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "opened", "split"),
    [
        ("plain answer", False, (None, "plain answer")),
        ("<think>a b</think>the answer", False, ("a b", "the answer")),
        ("<think>\nsteps\n</think>\n\nanswer", False, ("steps", "answer")),
        ("<think>ran out of tok", False, ("ran out of tok", "")),  # never closed: all reasoning
        ("steps</think>answer", True, ("steps", "answer")),  # the generation prompt opened the block
        ("no close", True, ("no close", "")),
        ("answer <think>x</think>", False, (None, "answer <think>x</think>")),  # no block first: text
    ],
)
def test_split_takes_the_leading_block_as_reasoning(completion, opened, split) -> None:
    assert reasoning.split(completion, opened) == split


def test_a_template_that_handles_think_marks_the_model_as_reasoning_unless_the_job_says() -> None:
    assert reasoning.enabled("auto", THINKING_TEMPLATE)
    assert reasoning.enabled("auto", "{{ message.reasoning_content }}")
    assert not reasoning.enabled("auto", build_char_tokenizer().chat_template)
    assert reasoning.enabled("think", build_char_tokenizer().chat_template)
    assert not reasoning.enabled("none", THINKING_TEMPLATE)


def test_thinking_off_uses_the_templates_switch_else_an_empty_block() -> None:
    def render(**switches) -> str:
        return "assistant: " + ("<think></think>" if switches.get("enable_thinking") is False else "")

    assert reasoning.no_thinking(render, "assistant: ", has_switch=True) == "<think></think>"
    assert reasoning.no_thinking(render, "assistant: ", has_switch=False) == reasoning.EMPTY_BLOCK
    assert reasoning.no_thinking(render, "assistant: <think>\n", has_switch=False) == "</think>\n\n"


# --- replies ------------------------------------------------------------------------------------------


async def test_openai_reasoning_content_and_tool_calls_after_the_block(app, backend) -> None:
    backend.script = ["<think>add them</think>" + CALL, "<think>so</think>three"]
    messages = [{"role": "user", "content": "1+2"}]
    reply = await oa(app).chat.completions.create(model="job-1", messages=messages, tools=OA_TOOLS, max_tokens=200)
    message = reply.choices[0].message
    assert message.reasoning_content == "add them"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"a": 1, "b": 2}]
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"

    stream = await oa(app).chat.completions.create(model="job-1", messages=messages, stream=True, max_tokens=200)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    # The reasoning streams as it is generated (a chunk per token here), before the content.
    assert len(thoughts) == 2 and "".join(thoughts) == "so" and "".join(d.content or "" for d in deltas) == "three"


async def test_anthropic_thinking_blocks_streamed_and_not(app, backend) -> None:
    backend.script = ["<think>hmm</think>four", "<think>again</think>five"]
    kwargs = {"model": "job-1", "max_tokens": 100, "messages": [{"role": "user", "content": "2+2"}]}
    reply = await an(app).messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == "hmm" and reply.content[0].signature == reasoning.signature("hmm")
    assert reply.content[1].text == "four"

    async with an(app).messages.stream(**kwargs) as stream:
        final = await stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "again"),
        ("text", "five"),
    ]
    assert final.content[0].signature == reasoning.signature("again")


async def test_responses_reasoning_items_streamed_and_not(app, backend) -> None:
    backend.script = ["<think>think</think>six", "<think>more</think>seven"]
    reply = await oa(app).responses.create(
        model="job-1", input="3+3", reasoning={"summary": "auto"}, max_output_tokens=99
    )
    thought, said = reply.output
    assert thought.type == "reasoning" and [c.text for c in thought.content] == ["think"]
    assert [s.text for s in thought.summary] == ["think"]  # no summarizer: the summary is the reasoning
    assert said.type == "message" and said.content[0].text == "six"
    assert reply.usage.output_tokens_details.reasoning_tokens == len("<think>think</think>")

    stream = await oa(app).responses.create(
        model="job-1", input="3+3", stream=True, max_output_tokens=99, reasoning={"effort": None, "summary": None}
    )
    events = [e async for e in stream]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "more"
    [done] = [e for e in events if e.type == "response.completed"]
    assert [i.type for i in done.response.output] == ["reasoning", "message"]
    assert done.response.output[0].summary == []  # none asked for


async def test_a_block_never_closed_is_all_reasoning_and_an_invalid_action(app, backend) -> None:
    backend.script = ["<think>this goes on and on"]
    session = {SESSION_HEADER: "unclosed"}
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "x"}], max_tokens=12, extra_headers=session
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.reasoning_content == "this" and choice.message.content == ""
    recorded = await trajectory(app, "unclosed")
    assert recorded["invalid_actions"] == 1
    assert text(backend, recorded["segments"][0]["turns"][0]["completions"][0]["token_ids"]) == "<think>this "


async def test_a_generation_prompt_that_opens_the_block_makes_the_reply_reasoning_until_it_closes() -> None:
    # DeepSeek R1's way: the generation prompt ends in "<think>", the model writes only the closing tag.
    tokenizer = build_thinking_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE.replace(
        "{% if add_generation_prompt %}assistant: ", "{% if add_generation_prompt %}assistant: <think>"
    )
    backend = ScriptedBackend(tokenizer, reasoning=True, limits=True)
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    backend.script = ["steps</think>answer", "on and on and on", "late"]
    messages = [{"role": "user", "content": "q"}]
    reply = await oa(app).chat.completions.create(model="job-1", messages=messages, max_tokens=50)
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("steps", "answer")
    budgeted = await an(app).messages.create(
        model="job-1", max_tokens=50, messages=messages, thinking={"type": "enabled", "budget_tokens": 6}
    )
    assert [getattr(b, "thinking", None) or getattr(b, "text", None) for b in budgeted.content] == ["on and", "late"]
    assert text(backend, backend.prompts[2]).endswith("assistant: <think>on and\n</think>\n\n")


# --- history modulo reasoning -------------------------------------------------------------------------


async def test_an_openai_client_that_drops_reasoning_continues_one_segment(app, backend) -> None:
    backend.script = ["<think>r one</think>a one", "<think>r two</think>a two", "<think>r three</think>a three"]
    session = {SESSION_HEADER: "drops"}
    client = oa(app)
    messages = [{"role": "user", "content": "q one"}]
    for question in ("q two", "q three", None):
        reply = await client.chat.completions.create(
            model="job-1", messages=messages, max_tokens=99, extra_headers=session
        )
        # What an OpenAI client sends back: content only (reasoning_content is not a request field of the API).
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        if question:
            messages += [{"role": "user", "content": question}]
    recorded = await trajectory(app, "drops")
    assert recorded["splits"] == {} and len(recorded["segments"]) == 1
    [segment] = recorded["segments"]
    assert [t["extends"] for t in segment["turns"]] == ["start", "reply", "reply"]
    # The third prompt holds the first two replies as sampled, think tokens included (the template alone
    # would have dropped them), and every think token is trained.
    third = text(backend, backend.prompts[2])
    assert "assistant: <think>r one</think>a one" in third and "assistant: <think>r two</think>a two" in third
    assert third.endswith("user: q three\nassistant: ")
    assert trained_text(backend, segment) == "".join(f"<think>r {n}</think>a {n}<eos>" for n in ("one", "two", "three"))


async def test_an_openai_client_that_sends_reasoning_content_back_continues_one_segment(app, backend) -> None:
    backend.script = ["<think>first</think>" + CALL, "<think>second</think>done"]
    session = {SESSION_HEADER: "keeps"}
    messages = [{"role": "user", "content": "add"}]
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=messages, tools=OA_TOOLS, max_tokens=200, extra_headers=session
    )
    sent_back = reply.choices[0].message.model_dump(exclude_none=True)
    assert sent_back["reasoning_content"] == "first"
    messages += [sent_back, {"role": "tool", "tool_call_id": sent_back["tool_calls"][0]["id"], "content": "3"}]
    await oa(app).chat.completions.create(
        model="job-1", messages=messages, tools=OA_TOOLS, max_tokens=200, extra_headers=session
    )
    recorded = await trajectory(app, "keeps")
    assert recorded["splits"] == {} and [t["extends"] for t in recorded["segments"][0]["turns"]] == ["start", "reply"]
    assert text(backend, backend.prompts[1]).endswith("<think>first</think>" + CALL + "<eos>\ntool: 3\nassistant: ")


async def test_an_anthropic_client_that_sends_thinking_blocks_back_continues_one_segment(app, backend) -> None:
    backend.script = ["<think>t one</think>b one", "<think>t two</think>b two", "<think>t three</think>b three"]
    session = {SESSION_HEADER: "claude"}
    client = an(app)
    messages: list[dict] = [{"role": "user", "content": "p one"}]
    for question in ("p two", "p three", None):
        reply = await client.messages.create(model="job-1", max_tokens=100, messages=messages, extra_headers=session)
        assert reply.content[0].type == "thinking"
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]}]
        if question:
            messages += [{"role": "user", "content": question}]
    recorded = await trajectory(app, "claude")
    assert recorded["splits"] == {} and len(recorded["segments"]) == 1
    third = text(backend, backend.prompts[2])
    assert "<think>t one</think>b one" in third and "<think>t two</think>b two" in third


async def test_a_responses_client_that_sends_reasoning_items_back_continues_one_segment(app, backend) -> None:
    backend.script = ["<think>s one</think>" + CALL, "<think>s two</think>c two", "<think>s three</think>c three"]
    call = {"extra_headers": {SESSION_HEADER: "responses"}, "max_output_tokens": 200}
    client = oa(app)
    tool = {"type": "function", "name": "add", "parameters": {"type": "object"}}
    items: list[dict] = [{"role": "user", "content": "add"}]
    reply = await client.responses.create(model="job-1", input=items, tools=[tool], **call)
    assert [i.type for i in reply.output] == ["reasoning", "function_call"]
    items += [i.model_dump(exclude_none=True) for i in reply.output]
    items += [{"type": "function_call_output", "call_id": reply.output[1].call_id, "output": "3"}]
    reply = await client.responses.create(model="job-1", input=items, tools=[tool], **call)
    items += [i.model_dump(exclude_none=True) for i in reply.output] + [{"role": "user", "content": "and"}]
    await client.responses.create(model="job-1", input=items, tools=[tool], **call)
    recorded = await trajectory(app, "responses")
    assert recorded["splits"] == {} and [t["extends"] for t in recorded["segments"][0]["turns"]] == [
        "start",
        "reply",
        "reply",
    ]
    assert "<think>s two</think>c two" in text(backend, backend.prompts[2])


# --- thinking off and budgets -------------------------------------------------------------------------


async def test_thinking_off_writes_the_templates_empty_block_as_context(app, backend) -> None:
    backend.script = ["four", "five"]
    session = {SESSION_HEADER: "off"}
    messages: list[dict] = [{"role": "user", "content": "2+2"}]
    client = an(app)
    reply = await client.messages.create(
        model="job-1", max_tokens=50, messages=messages, thinking={"type": "disabled"}, extra_headers=session
    )
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "four"
    assert text(backend, backend.prompts[0]).endswith("assistant: <think></think>")
    messages += [{"role": "assistant", "content": "four"}, {"role": "user", "content": "+1"}]
    await client.messages.create(model="job-1", max_tokens=50, messages=messages, extra_headers=session)
    recorded = await trajectory(app, "off")
    [segment] = recorded["segments"]
    assert [t["extends"] for t in segment["turns"]] == ["start", "reply"]
    assert trained_text(backend, segment) == "four<eos>five<eos>"  # the empty block is context
    assert text(backend, segment["token_ids"]).startswith("user: 2+2\nassistant: <think></think>four<eos>")

    await oa(app).chat.completions.create(model="job-1", messages=messages[:1], reasoning_effort="none")
    assert text(backend, backend.prompts[-1]).endswith("assistant: <think></think>")


@pytest.mark.parametrize(("reasons", "written"), [(True, reasoning.EMPTY_BLOCK), (False, "")])
async def test_thinking_off_without_a_template_switch(reasons, written) -> None:
    # The character template has no enable_thinking switch: a model the job says reasons gets an empty block,
    # one that does not reason is asked nothing.
    backend = ScriptedBackend(reasoning=reasons)
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    await an(app).messages.create(
        model="job-1", max_tokens=50, messages=[{"role": "user", "content": "q"}], thinking={"type": "disabled"}
    )
    assert text(backend, backend.prompts[0]) == "user: q\nassistant: " + written


async def test_a_budget_that_runs_out_closes_the_block_as_context_and_the_answer_follows(app, backend) -> None:
    backend.script = ["<think>long long reasoning</think>never", "the answer"]
    session = {SESSION_HEADER: "budget"}
    reply = await an(app).messages.create(
        model="job-1",
        max_tokens=40,
        messages=[{"role": "user", "content": "q"}],
        thinking={"type": "enabled", "budget_tokens": 12},
        extra_headers=session,
    )
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", "long"),
        ("text", "the answer"),
    ]
    first, second = backend.sampling
    assert first.max_new_tokens == 12 and list(first.stop) == ["</think>"]
    assert second.max_new_tokens == 40 - 12 and list(second.stop) == []
    forced = "\n</think>\n\n"
    assert backend.prompts[1] == backend.prompts[0] + backend.model_.renderer.encode("<think>long " + forced)
    recorded = await trajectory(app, "budget")
    [segment] = recorded["segments"]
    [completion] = segment["turns"][0]["completions"]
    assert text(backend, completion["token_ids"]) == "<think>long " + forced + "the answer<eos>"
    assert completion["forced"] == list(range(12, 12 + len(forced)))
    assert trained_text(backend, segment) == "<think>long the answer<eos>"  # the forced tag is not trained
    assert recorded["invalid_actions"] == 0
    assert reply.usage.output_tokens == 12 + len("the answer") + 1  # sampled tokens only (eos included)


async def test_a_budget_the_model_keeps_samples_the_answer_after_its_own_closing(app, backend) -> None:
    backend.script = ["<think>ok</think>", "yes"]
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "q"}], max_tokens=40, reasoning_effort="medium"
    )
    assert reply.choices[0].message.reasoning_content == "ok" and reply.choices[0].message.content == "yes"
    first, second = backend.sampling
    assert first.max_new_tokens == 20  # medium: half the reply's limit
    assert second.max_new_tokens == 40 - len("<think>ok</think>")
    assert backend.prompts[1] == backend.prompts[0] + backend.model_.renderer.encode("<think>ok</think>")


async def test_a_reply_that_ends_within_the_budget_is_one_call(app, backend) -> None:
    backend.script = ["short"]
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "q"}], max_tokens=40, reasoning_effort="high"
    )
    assert reply.choices[0].message.content == "short" and len(backend.sampling) == 1


async def test_each_choice_of_a_budgeted_call_gets_its_own_answer_call(app, backend) -> None:
    backend.script = ["<think>a</think>", "<think>runs on and on", "one", "two"]
    session = {SESSION_HEADER: "two"}
    reply = await oa(app).chat.completions.create(
        model="job-1",
        messages=[{"role": "user", "content": "q"}],
        max_tokens=80,
        n=2,
        reasoning_effort="low",
        extra_headers=session,
    )
    assert [(c.message.reasoning_content, c.message.content) for c in reply.choices] == [
        ("a", "one"),
        ("runs on and o", "two"),  # low: a quarter of 80 tokens, "<think>" included
    ]
    [turn] = (await trajectory(app, "two"))["segments"][0]["turns"]
    assert [len(c["forced"]) for c in turn["completions"]] == [0, len("\n</think>\n\n")]


async def test_a_turn_with_thinking_off_is_retried_and_dropped_within_its_segment(app, backend) -> None:
    backend.script = ["not this", "<think>t</think>nor this", "fine"]
    session = {SESSION_HEADER: "prefill"}
    client = an(app)
    messages: list[dict] = [{"role": "user", "content": "q"}]
    off = {"thinking": {"type": "disabled"}}
    await client.messages.create(model="job-1", max_tokens=50, messages=messages, extra_headers=session, **off)
    # The same history again, thinking on: the retry's prompt is the first one's without its empty block.
    await client.messages.create(model="job-1", max_tokens=50, messages=messages, extra_headers=session)
    empty = backend.model_.renderer.encode("<think></think>")
    assert backend.prompts[0] == backend.prompts[1] + empty
    # The reply dropped and a new message: its context, without the empty block, goes on.
    messages += [{"role": "user", "content": "again"}]
    await client.messages.create(model="job-1", max_tokens=50, messages=messages, extra_headers=session, **off)
    [segment] = (await trajectory(app, "prefill"))["segments"]
    assert [t["extends"] for t in segment["turns"]] == ["start", "retry", "context"]
    assert text(backend, backend.prompts[2]).endswith("user: q\nuser: again\nassistant: <think></think>")


async def test_reasoning_content_on_a_message_that_is_not_the_assistants_is_refused(app) -> None:
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].reasoning_content"):
        await oa(app).chat.completions.create(
            model="job-1", messages=[{"role": "user", "content": "q", "reasoning_content": "x"}]
        )


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"thinking": {"type": "disabled", "budget_tokens": 9}}, "thinking.budget_tokens"),
        ({"reasoning": {"effort": "low", "generate_summary": "auto"}}, "reasoning.generate_summary"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ],
)
async def test_thinking_requests_the_endpoint_cannot_honour_are_refused_by_name(app, call, named) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    if "thinking" in call:
        route, body = "/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}
    elif "reasoning" in call:
        route, body = "/v1/responses", {"input": "q"}
    else:
        route, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]}
    got = await http.post(route, json={"model": "job-1", **body, **call}, headers={"x-api-key": TOKEN})
    assert got.status_code == 400 and got.json()["error"]["message"].startswith(named)
