"""Strict tool calls at the endpoint, through the official clients and the built-in scaffold (the scripted
backend of test_app): a call that names an unknown tool, lacks or misnames its arguments, or carries
arguments that are not an object or break the tool's schema is an invalid action. It comes back as the
model's text (no tool call, finish_reason "stop"), the session counts it (`invalid_actions`, which
grpo.invalid_action_penalty penalizes), and it never reaches a tool. A valid call is a call, as before.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import openai
import pytest

from dockyard.agents.contract import SESSION_HEADER, TrajectoryDocument
from dockyard.agents.scaffold import Budget, run_scaffold
from dockyard.agents.tools import Toolbox
from dockyard.api.common.v1 import common_pb2
from dockyard.config import GRPOConfig, SamplingConfig, ToolConfig
from services.coordinator.rewards import shape_rewards
from tests.unit.agents.test_tools import RecordingSession
from tests.unit.endpoint.scripted import TOKEN, an, oa

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
OA_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
AN_TOOLS = [{"name": "add", "input_schema": ADD}]


def call(body: dict) -> str:
    return f"<tool_call>{json.dumps(body)}</tool_call>"


VALID = call({"name": "add", "arguments": {"a": 1, "b": 2}})
INVALID = {
    "unknown name": call({"name": "sub", "arguments": {"a": 1, "b": 2}}),
    "missing arguments": call({"name": "add"}),
    "misnamed arguments": call({"name": "add", "ahguments": {"a": 1, "b": 2}}),
    "an extra key": call({"name": "add", "arguments": {"a": 1, "b": 2}, "id": "x"}),
    "arguments not an object": call({"name": "add", "arguments": "a=1, b=2"}),
    "arguments a list": call({"name": "add", "arguments": [1, 2]}),
    "a required parameter missing": call({"name": "add", "arguments": {"a": 1}}),
    "an ill-typed parameter": call({"name": "add", "arguments": {"a": 1, "b": "2"}}),
    "an unknown parameter": call({"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}),
    "one bad call of two": VALID + call({"name": "add", "arguments": {"a": True, "b": 2}}),
}


def as_text(backend, text: str) -> str:
    """The reply's content when the completion is text: what the model wrote, decoded."""
    renderer = backend.model_.renderer
    return renderer.decode(renderer.encode(text))


async def trajectory(app, session: str) -> dict:
    return (await oa(app).get(f"/sessions/{session}/trajectory", cast_to=httpx.Response)).json()


@pytest.mark.parametrize("text", INVALID.values(), ids=INVALID.keys())
async def test_an_invalid_call_is_text_and_counted_through_openai(app, backend, text: str) -> None:
    backend.script = [text]
    reply = await oa(app).chat.completions.create(
        model="job-1",
        messages=[{"role": "user", "content": "add 1 2"}],
        tools=OA_TOOLS,
        extra_headers={SESSION_HEADER: "s"},
    )
    choice = reply.choices[0]
    assert choice.message.content == as_text(backend, text)
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert (await trajectory(app, "s"))["invalid_actions"] == 1


@pytest.mark.parametrize("text", INVALID.values(), ids=INVALID.keys())
async def test_an_invalid_call_is_text_through_the_openai_stream(app, backend, text: str) -> None:
    backend.script = [text]
    content, calls, finish = "", [], None
    async for chunk in await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "add 1 2"}], tools=OA_TOOLS, stream=True
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert (content, calls, finish) == (as_text(backend, text), [], "stop")


@pytest.mark.parametrize("text", INVALID.values(), ids=INVALID.keys())
async def test_an_invalid_call_is_text_and_counted_through_anthropic(app, backend, text: str) -> None:
    backend.script = [text]
    reply = await an(app).messages.create(
        model="job-1",
        max_tokens=16,
        messages=[{"role": "user", "content": "add 1 2"}],
        tools=AN_TOOLS,
        extra_headers={SESSION_HEADER: "s"},
    )
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "end_turn"
    assert reply.content[0].text == as_text(backend, text)
    document = (await an(app).get("/v1/sessions/s/trajectory", cast_to=httpx2.Response)).json()
    assert document["invalid_actions"] == 1


async def test_a_valid_call_is_still_a_call_and_not_counted(app, backend) -> None:
    backend.script = [VALID]
    reply = await oa(app).chat.completions.create(
        model="job-1",
        messages=[{"role": "user", "content": "add 1 2"}],
        tools=OA_TOOLS,
        extra_headers={SESSION_HEADER: "s"},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert (await trajectory(app, "s"))["invalid_actions"] == 0


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"type": 5}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"$ref": "http://schemas.example/a"}}}, "fetches nothing"),
        ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ],
)
async def test_a_tool_schema_calls_cannot_be_judged_by_is_a_400(app, backend, parameters, says) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError, match=says):
        await oa(app).chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}], tools=tools)
    with pytest.raises(anthropic.BadRequestError, match=says):
        await an(app).messages.create(
            model="job-1",
            max_tokens=16,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "add", "input_schema": parameters}],
        )
    assert backend.prompts == []  # refused before any replica was asked
    backend.script = [VALID]  # and the endpoint goes on serving
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "x"}], tools=OA_TOOLS
    )
    assert reply.choices[0].finish_reason == "tool_calls"


async def test_a_tool_without_parameters_takes_none(app, backend) -> None:
    tools = [{"type": "function", "function": {"name": "now"}}]  # OpenAI: no parameters, no arguments
    backend.script = [call({"name": "now", "arguments": {}}), call({"name": "now", "arguments": {"tz": "UTC"}})]
    client = oa(app)
    first = await client.chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "x"}], tools=tools
    )
    second = await client.chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "x"}], tools=tools
    )
    assert first.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


F = [ToolConfig(name="f", parameters={"x": "integer"}, command=["python3", "f.py", "{x}"])]
F_CALLS = {
    "unknown name": call({"name": "g", "arguments": {"x": 1}}),
    "missing arguments": call({"name": "f"}),
    "misnamed arguments": call({"name": "f", "ahguments": {"x": 1}}),
    "arguments not an object": call({"name": "f", "arguments": 1}),
    "schema-invalid arguments": call({"name": "f", "arguments": {"x": "1"}}),
    "an unknown parameter": call({"name": "f", "arguments": {"x": 1, "y": 2}}),
}


def scaffold_client(app) -> openai.AsyncOpenAI:
    return oa(app, TOKEN).with_options(default_headers={SESSION_HEADER: "trial"})


@pytest.mark.parametrize("text", F_CALLS.values(), ids=F_CALLS.keys())
async def test_the_built_in_scaffold_gets_an_invalid_call_as_text_and_runs_no_tool(app, backend, text) -> None:
    backend.script = [call({"name": "f", "arguments": {"x": 3}}), text]
    session = RecordingSession()
    outcome = await run_scaffold(
        scaffold_client(app), "job-1", "find f", F, Toolbox(F, session), SamplingConfig(), Budget(4, 10_000, 60)
    )
    assert session.calls == [("run", ["python3", "f.py", "3"], None)]  # the valid call ran; the invalid none
    assert (outcome.finish_reason, outcome.turns, outcome.answer) == ("answer", 2, as_text(backend, text))
    document = TrajectoryDocument.parse(await trajectory(app, "trial"))
    assert (document.turns, document.invalid_actions) == (2, 1)
    # What the coordinator makes of it (agent_trials copies the count), penalized when configured.
    scored = common_pb2.Trajectory(reward=1.0, valid=True, invalid_actions=document.invalid_actions)
    shape_rewards([scored], GRPOConfig(invalid_action_penalty=0.5))
    assert scored.reward == 0.5


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("g", '{"x": 1}'),
        ("f", "1"),
        ("f", '"{\\"x\\": 1}"'),
        ("f", '{"x": "1"}'),
        ("f", '{"x": 1, "y": 2}'),
        ("f", "{"),
    ],
)
async def test_the_toolbox_refuses_what_the_endpoint_refuses(name: str, arguments: str) -> None:
    """The same rule in the scaffold's own tool runner, for a call that did not come through the endpoint."""
    session = RecordingSession()
    result = await Toolbox(F, session).call(name, arguments)
    assert result.text.startswith("error: ") and result.submitted is None and session.calls == []
