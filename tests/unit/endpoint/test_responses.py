"""POST /v1/responses through the official `openai` client (strict response validation) and the OpenAI
Agents SDK's default model, on the scripted backend of test_app: replies, the typed stream, a session
that continues its segment when the client sends the output items back, and what is refused by name."""

from __future__ import annotations

import json

import agents
import httpx
import openai
import pytest

from dockyard.agents.contract import SESSION_HEADER
from tests.unit.endpoint.scripted import CALL, TOKEN

ADD = {
    "type": "function",
    "name": "add",
    "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


def strict(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return openai.AsyncOpenAI(
        base_url="http://endpoint/v1", api_key=TOKEN, http_client=http, max_retries=0, _strict_response_validation=True
    )


async def trajectory(app, session: str) -> dict:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    return (await http.get(f"/v1/sessions/{session}/trajectory", headers={"x-api-key": TOKEN})).json()


async def test_a_call_then_its_output_continue_one_recorded_segment(app, backend) -> None:
    client = strict(app)
    session = {SESSION_HEADER: "resp"}
    backend.script = [CALL, "three"]
    first = await client.responses.create(
        model="job-1", instructions="use the tools", input="add 1 and 2", tools=[ADD], extra_headers=session
    )
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "add", {"a": 1, "b": 2})
    assert first.status == "completed" and first.usage.input_tokens == len(backend.prompts[0])
    history = [
        {"role": "user", "content": "add 1 and 2"},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": "3"},
    ]
    second = await client.responses.create(
        model="job-1", instructions="use the tools", input=history, tools=[ADD], extra_headers=session
    )
    assert second.output_text == "three"
    # The second prompt extends the first prompt and the sampled call: one segment, nothing re-encoded.
    assert backend.prompts[1][: len(backend.prompts[0])] == backend.prompts[0]
    record = await trajectory(app, "resp")
    assert record["turns"] == 2 and record["splits"] == {} and len(record["segments"]) == 1


async def test_the_stream_carries_the_reply_as_typed_events_in_order(app, backend) -> None:
    backend.script = ["hello there"]
    stream = await strict(app).responses.create(model="job-1", input="hi", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "hello there"  # the text as it was generated
    assert [k for i, k in enumerate(kinds) if k != kinds[i - 1]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "hello there" and events[-1].response.usage.output_tokens > 0
    backend.script = [CALL]
    stream = await strict(app).responses.create(model="job-1", input="add", tools=[ADD], stream=True)
    done = [e async for e in stream if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"a": 1, "b": 2}]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "e"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),  # the model does not reason
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}]},
            "input[0].arguments",
        ),
    ],
)
async def test_what_the_endpoint_does_not_do_is_refused_by_name(app, fields, named) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await strict(app).responses.create(model="job-1", **fields)
    assert info.value.body["message"].startswith(named), info.value.body["message"]


async def test_a_required_call_the_reply_does_not_make_is_an_invalid_action(app, backend) -> None:
    backend.script = ["no call"]
    reply = await strict(app).responses.create(
        model="job-1", input="add", tools=[ADD], tool_choice="required", extra_headers={SESSION_HEADER: "req"}
    )
    assert reply.output_text == "no call"
    assert (await trajectory(app, "req"))["invalid_actions"] == 1


async def test_the_agents_sdk_default_model_runs_a_function_tool(app, backend) -> None:
    agents.set_tracing_disabled(True)  # no trace upload
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    client = openai.AsyncOpenAI(base_url="http://endpoint/v1", api_key=TOKEN, http_client=http, max_retries=0)
    seen = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    backend.script = [CALL, "the sum is 3"]
    model = agents.OpenAIResponsesModel(model="job-1", openai_client=client)
    agent = agents.Agent(name="adder", instructions="use the tools", tools=[add], model=model)
    result = await agents.Runner.run(agent, "add 1 and 2")
    assert seen == [(1, 2)] and result.final_output == "the sum is 3"
    # The tool's result reached the model's second prompt.
    renderer = backend.model_.renderer
    assert "3" in renderer.decode(backend.prompts[1][len(backend.prompts[0]) :])
