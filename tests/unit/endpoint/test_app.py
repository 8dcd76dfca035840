"""The endpoint's HTTP surface through the official openai and anthropic clients, with a scripted backend.

The backend returns known completions (no model), so tool-call parsing, the reply and stream formats, sessions,
auth and error codes are checked deterministically through the same code path a real replica's output takes.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import openai
import pytest

from dockyard.agents.contract import SESSION_HEADER
from dockyard.config.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.unit.endpoint.scripted import AN_TOOLS, CALL, OA_TOOLS, TOKEN, an, oa


async def test_openai_tool_call_is_structured_and_the_next_turn_reuses_tokens(app, backend) -> None:
    backend.script = [CALL, "3"]
    client = oa(app)
    messages = [{"role": "user", "content": "add 1 2"}]
    headers = {SESSION_HEADER: "s1"}
    first = await client.chat.completions.create(
        model="job-1", messages=messages, tools=OA_TOOLS, extra_headers=headers, logprobs=True
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert [t.logprob for t in choice.logprobs.content] == [-0.25] * (len(CALL) + 1)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    second = await client.chat.completions.create(
        model="job-1", messages=messages, tools=OA_TOOLS, extra_headers=headers
    )
    assert second.choices[0].message.content == "3"
    renderer = backend.model_.renderer
    first_ids = backend.prompts[0] + renderer.encode(CALL) + [renderer.eos_token_id]
    assert backend.prompts[1][: len(first_ids)] == first_ids
    trajectory = (await client.get("/sessions/s1/trajectory", cast_to=httpx.Response)).json()
    assert len(trajectory["segments"]) == 1 and trajectory["turns"] == 2
    assert sum(trajectory["segments"][0]["loss_mask"]) == len(CALL) + 1 + 2
    # The conversation as rendered (what a run exports for SFT): the last call's messages and its reply.
    conversation = trajectory["segments"][0]["messages"]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    assert conversation[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert conversation[-1] == {"role": "assistant", "content": "3"}
    assert trajectory["segments"][0]["tools"][0]["function"]["name"] == "add"


async def test_openai_stream_carries_text_and_tool_calls(app, backend) -> None:
    backend.script = ["hello", CALL]
    client = oa(app)
    text = ""
    async for chunk in await client.chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "hi"}], stream=True
    ):
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == "hello"
    calls = []
    async for chunk in await client.chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "hi"}], tools=OA_TOOLS, stream=True
    ):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            if c.finish_reason:
                assert c.finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["add"]


async def test_malformed_call_comes_back_as_text(app, backend) -> None:
    backend.script = ['<tool_call>{"name": "add", "arguments": {</tool_call>']
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "hi"}], tools=OA_TOOLS
    )
    assert reply.choices[0].message.content == backend.model_.renderer.decode(
        backend.model_.renderer.encode('<tool_call>{"name": "add", "arguments": {</tool_call>')
    )
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"


async def test_anthropic_tool_use_round_trip_streaming_and_not(app, backend) -> None:
    backend.script = [CALL, "three", CALL]
    client = an(app)
    headers = {SESSION_HEADER: "s2"}
    messages = [{"role": "user", "content": "add 1 2"}]
    first = await client.messages.create(
        model="job-1", max_tokens=16, messages=messages, tools=AN_TOOLS, extra_headers=headers
    )
    assert first.stop_reason == "tool_use"
    use = first.content[0]
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 1, "b": 2}
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]},
    ]
    second = await client.messages.create(
        model="job-1", max_tokens=16, system="be brief", messages=messages, tools=AN_TOOLS, extra_headers=headers
    )
    assert second.content[0].text == "three" and second.stop_reason == "end_turn"
    async with client.messages.stream(model="job-1", max_tokens=16, messages=messages[:1], tools=AN_TOOLS) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"a": 1, "b": 2}
    # A system prompt added afterwards is edited history: a second segment.
    trajectory = (await client.get("/v1/sessions/s2/trajectory", cast_to=httpx2.Response)).json()
    assert trajectory["splits"] == {"history_changed": 1}


async def test_errors(app, backend) -> None:
    client = oa(app)
    with pytest.raises(openai.AuthenticationError):
        await oa(app, key="wrong").chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="no such job"):
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="does not define"):
        await client.chat.completions.create(
            model="job-1",
            messages=[{"role": "user", "content": "x"}],
            tools=OA_TOOLS,
            tool_choice={"type": "function", "function": {"name": "rm"}},
        )
    # Stop strings are bounded before the rollout sees them (docs/limits.md): count and length.
    for stop in (["s"] * (MAX_STOP_STRINGS + 1), ["s" * (MAX_STOP_CHARS + 1)], [""]):
        with pytest.raises(openai.BadRequestError, match=f"at most {MAX_STOP_STRINGS} non-empty strings"):
            await client.chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}], stop=stop)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x" * 100_000}])
    assert info.value.status_code == 413
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    bad = await http.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    wrong = await http.post("/v1/chat/completions", json={"model": "job-1", "messages": [], "n": 0}, headers=headers)
    assert wrong.status_code == 422 and "messages" in wrong.json()["error"]["message"]
    one_turn = {"model": "job-1", "messages": [{"role": "user", "content": "x"}]}
    first = await http.post("/v1/chat/completions", json=one_turn, headers={**headers, SESSION_HEADER: "dies"})
    assert first.status_code == 200
    backend.lose = True
    lost = await http.post(
        "/v1/chat/completions",
        json={"model": "job-1", "messages": [{"role": "user", "content": "x"}]},
        headers={**headers, SESSION_HEADER: "dies"},
    )
    assert lost.status_code == 503 and lost.json()["error"]["type"] == "infrastructure_error"
    # A session that took no turn yet is not ended by a replica outage: it may start once one is back.
    fresh = await http.post("/v1/chat/completions", json=one_turn, headers={**headers, SESSION_HEADER: "early"})
    assert fresh.status_code == 503
    backend.lose = False
    early = await http.post("/v1/chat/completions", json=one_turn, headers={**headers, SESSION_HEADER: "early"})
    assert early.status_code == 200
    again = await http.post(
        "/v1/chat/completions",
        json={"model": "job-1", "messages": [{"role": "user", "content": "x"}]},
        headers={**headers, SESSION_HEADER: "dies"},
    )
    assert again.status_code == 409
    assert (await http.get("/v1/sessions/dies/trajectory", headers=headers)).json()["status"] == "infrastructure_error"
    # Other sessions keep being served.
    assert (await client.chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}])).choices


async def test_session_keys_and_models(app) -> None:
    client = oa(app)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["job-1"]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    opened = (await http.post("/v1/sessions", headers={"x-api-key": TOKEN})).json()
    scoped = oa(app, key=opened["api_key"])
    await scoped.chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}])
    got = await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers={"x-api-key": opened["api_key"]})
    assert got.status_code == 200 and got.json()["turns"] == 1
    forged = opened["api_key"][:-1] + ("0" if opened["api_key"][-1] != "0" else "1")
    assert (await http.get("/v1/models", headers={"x-api-key": forged})).status_code == 401
    assert (await http.delete(f"/v1/sessions/{opened['session_id']}", headers={"x-api-key": TOKEN})).status_code == 200


async def test_chunked_body_over_the_limit_is_413_and_calls_without_a_session_are_not_held(app) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}

    async def chunks():
        yield b'{"model": "job-1", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}]}'

    reply = await http.post("/v1/chat/completions", content=chunks(), headers=headers)
    assert reply.status_code == 413 and "over" in reply.json()["error"]["message"]
    body = {"model": "job-1", "messages": [{"role": "user", "content": "x"}]}
    served = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert served.status_code == 200 and SESSION_HEADER not in served.headers
    assert app.state.store.get("") is None and len(app.state.store) == 0


async def test_routing_state_is_served(app, backend) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    assert (await http.get("/v1/routing")).status_code == 401
    headers = {"authorization": f"Bearer {TOKEN}"}
    body = {"model": "job-1", "messages": [{"role": "user", "content": "x"}]}
    assert (await http.post("/v1/chat/completions", json=body, headers={**headers, SESSION_HEADER: "s"})).is_success
    state = (await http.get("/v1/routing", headers=headers)).json()
    assert state["sessions"] == 1 and state["admission"]["queue_depth"] == 0
    assert state["replicas"]["rollout"]["sessions"] == 1
    assert (await http.delete("/v1/sessions/s", headers=headers)).status_code == 200
    assert (await http.get("/v1/routing", headers=headers)).json()["replicas"]["rollout"]["sessions"] == 0


async def test_models_retrieve_count_tokens_and_model_lists_in_each_clients_shape(app, backend) -> None:
    # Strict response validation: each client checks every field of its own API's model shapes.
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    openai_client = openai.AsyncOpenAI(
        base_url="http://endpoint/v1", api_key=TOKEN, http_client=http, max_retries=0, _strict_response_validation=True
    )
    assert (await openai_client.models.retrieve("job-1")).owned_by == "dockyard"
    with pytest.raises(openai.NotFoundError) as missing:
        await openai_client.models.retrieve("job-2")
    assert missing.value.code == "model_not_found"
    http2 = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://endpoint")
    claude = anthropic.AsyncAnthropic(
        base_url="http://endpoint", api_key=TOKEN, http_client=http2, max_retries=0, _strict_response_validation=True
    )
    listed = await claude.models.list()
    assert [(m.id, m.type) for m in listed.data] == [("job-1", "model")] and listed.has_more is False
    assert (await claude.models.retrieve("job-1")).display_name == "job-1"
    # count_tokens is the prompt a call with the same conversation sends: its usage's input tokens.
    conversation = {"system": "be brief", "messages": [{"role": "user", "content": "add 1 and 2"}], "tools": AN_TOOLS}
    counted = await claude.messages.count_tokens(model="job-1", **conversation)
    served = await claude.messages.create(model="job-1", max_tokens=8, **conversation)
    assert counted.input_tokens == served.usage.input_tokens == len(backend.prompts[-1]) > 0
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.count_tokens(model="job-2", messages=[{"role": "user", "content": "x"}])


async def test_errors_carry_param_and_code_and_unknown_routes_name_themselves(app) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    headers = {"authorization": f"Bearer {TOKEN}"}
    unknown = await http.post("/v1/completions", json={"model": "job-1", "prompt": "x"}, headers=headers)
    error = unknown.json()["error"]
    assert unknown.status_code == 404 and error["code"] == "unsupported_route"
    assert "POST /v1/completions is not a route" in error["message"] and "endpoint-api.md" in error["message"]
    wrong_method = await http.get("/v1/chat/completions", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "unsupported_route"
    # A session the service token names that does not exist keeps its own message.
    gone = await http.get("/v1/sessions/nope/trajectory", headers=headers)
    assert gone.status_code == 404 and "no session" in gone.json()["error"]["message"]
    invalid = await http.post("/v1/chat/completions", json={"model": "job-1", "messages": [], "n": 0}, headers=headers)
    assert invalid.status_code == 422 and invalid.json()["error"] | {"message": None} == {
        "type": "invalid_request_error",
        "message": None,
        "param": "messages",
        "code": "invalid_value",
    }
    refused = await http.get("/v1/models", headers={"authorization": "Bearer wrong"})
    assert refused.json()["error"]["code"] == "invalid_api_key" and refused.json()["error"]["param"] is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"7": 100}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"extra_body": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ],
)
async def test_a_field_the_endpoint_does_not_implement_is_refused_by_name(app, fields, named) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oa(app).chat.completions.create(model="job-1", messages=[{"role": "user", "content": "x"}], **fields)
    assert info.value.body["message"].startswith(f"{named}: not")


async def test_neutral_values_and_fields_that_change_nothing_are_served(app) -> None:
    neutral = {
        "presence_penalty": 0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "user": "u",
        "store": False,
    }
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "x"}], parallel_tool_calls=True, **neutral
    )
    assert reply.choices[0].message.content == "ok"
    claude = an(app)
    # A budget asks for reasoning this job's model does not do (tests/unit/endpoint/test_reasoning.py: one that does).
    with pytest.raises(anthropic.BadRequestError, match="thinking.budget_tokens: the model does not reason"):
        await claude.messages.create(
            model="job-1",
            max_tokens=8,
            messages=[{"role": "user", "content": "x"}],
            thinking={"type": "enabled", "budget_tokens": 4},
        )
    served = await claude.messages.create(
        model="job-1", max_tokens=8, messages=[{"role": "user", "content": "x"}], metadata={"user_id": "u"}
    )
    assert served.content[0].text == "ok"


async def test_a_required_tool_call_the_reply_does_not_make_is_an_invalid_action(app, backend) -> None:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    headers = {"authorization": f"Bearer {TOKEN}"}
    client = oa(app)
    ask = [{"role": "user", "content": "add"}]
    cases = [
        ("required", "no call here", 1),
        ("required", CALL, 0),
        ({"type": "function", "function": {"name": "add"}}, "no call here", 1),
        ({"type": "function", "function": {"name": "add"}}, CALL, 0),
        ("auto", "no call here", 0),
    ]
    for i, (choice, text, invalid) in enumerate(cases):
        backend.script = [text]
        reply = await client.chat.completions.create(
            model="job-1", messages=ask, tools=OA_TOOLS, tool_choice=choice, extra_headers={SESSION_HEADER: f"r{i}"}
        )
        assert bool(reply.choices[0].message.tool_calls) == (text == CALL)  # returned as it came
        record = (await http.get(f"/v1/sessions/r{i}/trajectory", headers=headers)).json()
        assert record["invalid_actions"] == invalid, (choice, text)
    backend.script = ["no call here"]
    await an(app).messages.create(
        model="job-1",
        max_tokens=8,
        messages=ask,
        tools=AN_TOOLS,
        tool_choice={"type": "any"},
        extra_headers={SESSION_HEADER: "any"},
    )
    assert (await http.get("/v1/sessions/any/trajectory", headers=headers)).json()["invalid_actions"] == 1
    with pytest.raises(openai.BadRequestError, match="defines no `tools`"):
        await client.chat.completions.create(model="job-1", messages=ask, tool_choice="required")
