"""Real clients, unchanged, against `dockyard up`'s stack with the tiny job loaded; each session is trainable.

    openai (strict response validation): chat completions and Responses, streamed and not, function tools,
        top_logprobs
    anthropic (strict response validation): messages streamed and not, count_tokens, the model list, thinking
        off and under a budget (the job reasons: policy.reasoning=think)
    openai-agents: Runner.run and run_streamed with the SDK's default model (the Responses API) and a function tool
    litellm: completion / acompletion with model="openai/<job id>", streamed and not
        each client in its own session: its key (POST /v1/sessions) is the client's API key
    ──GET /v1/sessions/{id}/trajectory──> recorded.recording: the tokens the client was told of, and no other,
        trained ──recorded.trainable──> a sample the buffer and the trainer accept (their own code)

The job's model is random: it almost never writes a tool call, so each test asserts what the reply
allows (a call, or its absence counted as an invalid action where `tool_choice` asked for one) and
checks that the record says the same thing as the client saw.
"""

from __future__ import annotations

import asyncio
import json

import agents
import anthropic
import httpx
import openai
import pytest

from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.reasoning import EMPTY_BLOCK
from tests.integration.endpoint_stack import served_job
from tests.integration.recorded import open_session, recording, trainable

pytestmark = pytest.mark.slow

ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD_PARAMETERS}}]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):
    # The job is told its model reasons, so thinking requests are served (a random model practically never
    # opens a <think> block itself, so the other calls are answered as by a model that does not reason).
    logs, runs = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("runs")
    with served_job(logs, runs, replicas=1, overrides=("policy.reasoning=think",)) as served:
        yield served


def openai_client(job, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{job.base}/v1", api_key=key, max_retries=0, _strict_response_validation=True)


def test_openai_chat_completions_streamed_and_not(job) -> None:
    session, key = open_session(job)
    client = openai_client(job, key)
    assert client.models.retrieve(job.job_id).id == job.job_id
    messages: list[dict] = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    first = client.chat.completions.create(
        model=job.job_id, messages=messages, tools=CHAT_TOOLS, tool_choice="required", max_tokens=12, logprobs=True
    )
    choice = first.choices[0]
    called = bool(choice.message.tool_calls)
    assert choice.finish_reason in (("tool_calls",) if called else ("stop", "length"))
    messages.append(choice.message.model_dump(exclude_none=True))
    if called:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "4"} for c in choice.message.tool_calls]
    else:
        messages.append({"role": "user", "content": "again"})
    chunks = list(
        client.chat.completions.create(
            model=job.job_id,
            messages=messages,
            tools=CHAT_TOOLS,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices

    recorded = recording(job, session, turns=2, sampled=first.usage.completion_tokens + usage.completion_tokens)
    (segment,) = recorded.segments  # the second call went on from the first's sampled reply
    one, two = segment.turns
    assert two.extends == "reply" and two.parent == 0 and one.trained and two.trained
    assert [lp.logprob for lp in choice.logprobs.content] == one.completions[0].logprobs
    assert len(one.prompt_token_ids) == first.usage.prompt_tokens and len(two.prompt_token_ids) == usage.prompt_tokens
    assert segment.messages[-1]["content"] == streamed
    # tool_choice "required" with no valid call: returned as it came and counted as an invalid action.
    assert recorded.invalid_actions == (0 if called else 1)
    trainable(job, recorded)


def test_openai_top_logprobs_streamed_and_not(job) -> None:
    """top_logprobs through the whole stack (endpoint, Generate, the torch engine): each sampled token's entry
    lists 3 alternatives, most likely first, the first at least as likely as the token; the token's own logprob
    is the one recorded for training, and when it is among the alternatives it has the same logprob there."""
    session, key = open_session(job)
    client = openai_client(job, key)
    messages = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    reply = client.chat.completions.create(
        model=job.job_id, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3
    )
    chunks = client.chat.completions.create(
        model=job.job_id, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [entry for chunk in chunks for c in chunk.choices if c.logprobs for entry in c.logprobs.content]
    for entries in (reply.choices[0].logprobs.content, streamed):
        assert entries
        for entry in entries:
            alternatives = [t.logprob for t in entry.top_logprobs]
            assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
            assert alternatives[0] >= entry.logprob - 1e-6
            for t in entry.top_logprobs:
                if t.token == entry.token:
                    assert t.logprob == pytest.approx(entry.logprob, abs=1e-6)
    # The same messages twice: the second call retries the first, whose reply is then not trained.
    recorded = recording(job, session, turns=2, sampled=len(streamed))
    first, second = (turn for segment in recorded.segments for turn in segment.turns)
    assert second.extends == "retry" and second.trained and not first.trained
    assert [e.logprob for e in reply.choices[0].logprobs.content] == first.completions[0].logprobs
    assert [e.logprob for e in streamed] == second.completions[0].logprobs


def test_openai_responses_streamed_and_not(job) -> None:
    session, key = open_session(job)
    client = openai_client(job, key)
    tools = [{"type": "function", "name": "add", "parameters": ADD_PARAMETERS, "strict": True}]
    items: list = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    first = client.responses.create(
        model=job.job_id,
        instructions="be brief",
        input=items,
        tools=tools,
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=12,
    )
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens > 0
    calls = [item for item in first.output if item.type == "function_call"]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    if calls:  # the model called add: the follow-up turn gives each call its output
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "4"} for c in calls]
        assert all(json.loads(c.arguments).keys() == {"a", "b"} for c in calls)
    else:
        items.append({"role": "user", "content": "again"})
    with client.responses.stream(
        model=job.job_id, instructions="be brief", input=items, tools=tools, max_output_tokens=8
    ) as stream:
        events = list(stream)
    # The last event carries the response: completed, or incomplete at max_output_tokens (the client's
    # get_final_response() knows only the first).
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas and final.usage is not None

    recorded = recording(job, session, turns=2, sampled=first.usage.output_tokens + final.usage.output_tokens)
    (segment,) = recorded.segments
    one, two = segment.turns
    assert two.extends == "reply" and one.trained and two.trained
    assert len(one.prompt_token_ids) == first.usage.input_tokens
    assert len(two.prompt_token_ids) == final.usage.input_tokens
    for response, turn in ((first, one), (final, two)):  # incomplete exactly when the reply ran out of tokens
        assert (response.status == "incomplete") == (turn.completions[0].finish_reason == "length")
    if calls:
        assert [m["role"] for m in segment.messages][-len(calls) - 1 :] == ["tool"] * len(calls) + ["assistant"]
    # tool_choice named add: a reply without that call is counted as an invalid action.
    assert recorded.invalid_actions == (0 if calls else 1)
    trainable(job, recorded)


def test_anthropic_messages_count_tokens_and_models(job) -> None:
    session, key = open_session(job)
    client = anthropic.Anthropic(base_url=job.base, api_key=key, max_retries=0, _strict_response_validation=True)
    assert job.job_id in [m.id for m in client.models.list().data]
    assert client.models.retrieve(job.job_id).id == job.job_id
    tools = [{"name": "add", "input_schema": ADD_PARAMETERS}]
    messages: list[dict] = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    counted = client.messages.count_tokens(model=job.job_id, system="be brief", messages=messages, tools=tools)
    first = client.messages.create(
        model=job.job_id, max_tokens=8, system="be brief", messages=messages, tools=tools, tool_choice={"type": "any"}
    )
    assert counted.input_tokens == first.usage.input_tokens  # the same conversation, as the job's prompt
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use") and first.content
    uses = [block for block in first.content if block.type == "tool_use"]
    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]})
    if uses:
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "4"} for u in uses]}
        )
    else:
        messages.append({"role": "user", "content": "again"})
    with client.messages.stream(
        model=job.job_id, max_tokens=8, system="be brief", messages=messages, tools=tools
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == text and final.usage.output_tokens > 0

    recorded = recording(job, session, turns=2, sampled=first.usage.output_tokens + final.usage.output_tokens)
    (segment,) = recorded.segments  # count_tokens recorded nothing; the second call went on from the first
    one, two = segment.turns
    assert two.extends == "reply" and one.trained and two.trained
    assert len(two.prompt_token_ids) == final.usage.input_tokens
    assert recorded.invalid_actions == (0 if uses else 1)  # tool_choice "any" with no valid call
    trainable(job, recorded)


def test_anthropic_thinking_off_and_under_a_budget_streamed_and_not(job) -> None:
    session, key = open_session(job)
    client = anthropic.Anthropic(base_url=job.base, api_key=key, max_retries=0, _strict_response_validation=True)
    messages: list[dict] = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    off = client.messages.create(model=job.job_id, max_tokens=8, messages=messages, thinking={"type": "disabled"})
    assert off.content and off.stop_reason in ("end_turn", "max_tokens")
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in off.content]},
        {"role": "user", "content": "again"},
    ]
    budget = {"type": "enabled", "budget_tokens": 6}
    with client.messages.stream(model=job.job_id, max_tokens=16, messages=messages, thinking=budget) as stream:
        final = stream.get_final_message()
    # A thinking block is there when the model opened one, and then it is signed; the text follows it.
    assert all(b.signature.startswith("dockyard:") for b in final.content if b.type == "thinking")
    assert final.usage.output_tokens > 0
    # The same conversation again, not streamed: a retry of the streamed call, whose reply is then abandoned.
    whole = client.messages.create(model=job.job_id, max_tokens=16, messages=messages, thinking=budget)
    assert whole.content and whole.usage.output_tokens > 0

    recorded = recording(job, session, turns=3, sampled=off.usage.output_tokens + whole.usage.output_tokens)
    assert recorded.abandoned == {"retry": 1}
    first = recorded.segments[0].turns[0]
    # Thinking off: the template has no switch of its own, so an empty block follows the generation
    # prompt, written by the endpoint as context (prompt ids: never trained).
    prompt = build_char_tokenizer().decode(first.prompt_token_ids)
    assert prompt.endswith(EMPTY_BLOCK) and len(first.prompt_token_ids) == off.usage.input_tokens
    trainable(job, recorded)


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_sdk_default_model_with_a_function_tool(job, streamed: bool) -> None:
    session, key = open_session(job)
    paths: list[str] = []

    async def seen(request: httpx.Request) -> None:
        paths.append(request.url.path)

    client = openai.AsyncOpenAI(
        base_url=f"{job.base}/v1",
        api_key=key,
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx.AsyncClient(event_hooks={"request": [seen]}),
    )
    agents.set_tracing_disabled(True)  # nothing is uploaded
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    added: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        added.append((a, b))
        return a + b

    agent = agents.Agent(
        name="adder",
        instructions="use the tools",
        tools=[add],
        model=job.job_id,  # a name: the default provider's model, the Responses one as set above
        # Room to end by itself (a stop string or end of sequence): the SDK raises on a reply cut at
        # max_output_tokens (status "incomplete"), as it does against any Responses server.
        model_settings=agents.ModelSettings(max_tokens=400),
    )

    async def run() -> agents.RunResult | agents.RunResultStreaming:
        async with client:  # closed on the loop it ran on
            if not streamed:
                return await agents.Runner.run(agent, "add 1 and 2", max_turns=4)
            result = agents.Runner.run_streamed(agent, "add 1 and 2", max_turns=4)
            kinds = {event.type async for event in result.stream_events()}
            assert "raw_response_event" in kinds and result.is_complete
            return result

    result = asyncio.run(run())
    usage = result.context_wrapper.usage
    assert paths and set(paths) == {"/v1/responses"}  # the default model speaks the Responses API
    assert usage.requests == len(paths)

    recorded = recording(job, session, turns=len(paths), sampled=usage.output_tokens)
    assert isinstance(result.final_output, str)
    if added:  # the model called add: the SDK ran it and sent its output back in the next call
        assert len(paths) > 1
        assert any(m["role"] == "tool" for m in recorded.segments[-1].messages)
    else:  # the model's first reply was its final output
        assert len(paths) == 1 and recorded.segments[-1].messages[-1]["content"] == result.final_output
    trainable(job, recorded)


def test_litellm_completion_streamed_and_not(job, monkeypatch: pytest.MonkeyPatch) -> None:
    # litellm reads its model price map at import: from its own package, not fetched.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    session, key = open_session(job)
    route = {"model": f"openai/{job.job_id}", "api_base": f"{job.base}/v1", "api_key": key, "max_retries": 0}
    messages: list[dict] = [{"role": "user", "content": "f(0)=1 f(1)=3"}]
    first = litellm.completion(messages=messages, max_tokens=8, **route)
    reply = first.choices[0].message
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.completion_tokens > 0
    messages += [{"role": "assistant", "content": reply.content or ""}, {"role": "user", "content": "again"}]

    async def streamed() -> list:
        stream = await litellm.acompletion(
            messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}, **route
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in reversed(chunks) if getattr(c, "usage", None))

    recorded = recording(job, session, turns=2, sampled=first.usage.completion_tokens + usage.completion_tokens)
    (segment,) = recorded.segments
    assert segment.turns[1].extends == "reply" and segment.messages[-1]["content"] == text
    assert len(segment.turns[1].prompt_token_ids) == usage.prompt_tokens
    trainable(job, recorded)
