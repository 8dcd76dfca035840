"""A mixture-of-experts job's routing through the endpoint's sessions: each kept position's row, aligned with the
trajectory's tokens, is the row of the first turn on the kept path that ran it, cut with the tokens, and carried
to the trainer staged or not (docs/moe-routing.md).

The scripted replica (tests/unit/endpoint/scripted.py) returns a row for every position a call runs, naming the
position and the call; it keeps no prefix cache, so a later turn's prompt rows are its own re-prefill, and only
the earlier turn's rows may appear for positions that turn ran.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import redis

from dockyard.agents.contract import ContractError, StagedTrial, TrajectoryDocument
from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.agent_trial import assemble
from dockyard.experience.data_plane import DataPlane
from dockyard.experience.routing_layout import RoutingShape
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from services.trainer.requests import training_group
from tests.unit.endpoint.scripted import TOKEN, ScriptedBackend, an, oa
from tests.unit.endpoint.test_trial_staging import ADMIN, JOB, staging
from tests.unit.endpoint.thinking_tokenizer import build_thinking_tokenizer
from tests.unit.endpoint.trials import VariedBackend, record

SHAPE = RoutingShape(moe_layers=2, top_k=2, num_experts=256)


def routed(backend: ScriptedBackend) -> ScriptedBackend:
    backend.routing_shape = SHAPE
    backend.model_.routing = True
    return backend


def rows(segment) -> np.ndarray:
    """A document segment's routing as [positions, 2, 2]."""
    return np.frombuffer(base64.b64decode(segment["routing"]), np.uint8).reshape(-1, 2, 2)


def ran_by(routing: np.ndarray) -> list[int]:
    """Per row, the call that ran it (layer 1 of the scripted rows), after checking each row names its position."""
    positions = routing[:, 0, 0].astype(int) + 256 * routing[:, 0, 1].astype(int)
    np.testing.assert_array_equal(positions, np.arange(len(routing)))
    return routing[:, 1, 0].tolist()


def app_of(backend: ScriptedBackend):
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")


async def test_each_kept_position_has_the_row_of_the_first_kept_turn_that_ran_it() -> None:
    backend = routed(ScriptedBackend())
    app, http = app_of(backend)
    opened = (await http.post("/v1/sessions", headers=ADMIN)).json()
    client = oa(app, key=opened["api_key"])
    backend.script = ["run ls", "run pwd", "hmm", "run cat a", "run cat b", "done"]
    messages = [{"role": "system", "content": "one command per reply"}, {"role": "user", "content": "fix it"}]
    first = await client.chat.completions.create(model="job-1", messages=messages, n=2)  # call 0: choice 1 kept
    messages += [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "a.py"}]
    await client.chat.completions.create(model="job-1", messages=messages)  # call 1: "hmm", dropped
    messages += [{"role": "user", "content": "format error: one command"}]
    await client.chat.completions.create(model="job-1", messages=messages)  # call 2: retried by call 3
    retried = await client.chat.completions.create(model="job-1", messages=messages)
    messages += [retried.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b: 1"}]
    await client.chat.completions.create(model="job-1", messages=messages)  # call 4

    got = await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers=ADMIN)
    document = TrajectoryDocument.parse(got.content)
    assert document.routing_shape is not None and document.routing_shape.model_dump() == vars(SHAPE)
    [segment] = got.json()["segments"]
    renderer = backend.model_.renderer

    def ids(text: str) -> list[int]:
        return renderer.encode(text) + [renderer.eos_token_id]

    p0, p3, p4 = (len(backend.prompts[i]) for i in (0, 3, 4))
    kept0, kept3 = len(ids("run pwd")), len(ids("run cat b"))
    routing = rows(segment)
    assert len(routing) == len(segment["token_ids"]) - 1 == p4 + len(ids("done")) - 1
    # Call 0 ran its prompt and its kept reply but the last token; calls 1 and 2 are off the path, so call 3
    # is the first kept turn to run what follows (call 0's last token, then its new context); then call 4.
    expected = [0] * (p0 + kept0 - 1) + [3] * (p3 + kept3 - 1 - (p0 + kept0 - 1))
    expected += [4] * (len(routing) - len(expected))
    assert ran_by(routing) == expected

    # Cut by max_trial_tokens: the routing is cut with the tokens, one row per kept position but the last.
    budget = p3 + 2
    tokens = trial_tokens(got.json(), max_tokens=budget)
    assert tokens.truncated
    [cut] = tokens.segments
    assert len(cut.prompt_ids) + len(cut.completion_ids) == budget
    np.testing.assert_array_equal(np.frombuffer(cut.routing, np.uint8).reshape(-1, 2, 2), routing[: budget - 1])

    # As the trainer reads it, unstaged and packed: the rows beside the tokens they route.
    message = trajectory_message(tokens, trajectory_id="g/0", valid=True)
    group = common_pb2.Group(group_id="g", job_id=JOB, trajectories=[message])
    for sample in (training_group(group).samples[0], training_group(*packed.split(group)).samples[0]):
        assert sample.routing.shape == (budget - 1, 2, 2)
        np.testing.assert_array_equal(sample.routing, routing[: budget - 1])


async def test_an_edited_history_opens_a_segment_that_carries_its_own_turns_rows() -> None:
    backend = routed(ScriptedBackend())
    app, http = app_of(backend)
    opened = (await http.post("/v1/sessions", headers=ADMIN)).json()
    client = oa(app, key=opened["api_key"])
    backend.script = ["run ls", "run pwd", "run cat", "done"]
    messages = [{"role": "system", "content": "one command per reply"}, {"role": "user", "content": "fix it"}]
    for k in range(4):  # call 2 edits the first user message: a new segment; call 3 extends it
        if k == 2:
            messages[1] = {"role": "user", "content": "fix it, edited"}
        reply = await client.chat.completions.create(model="job-1", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"out {k}"}]

    got = (await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers=ADMIN)).json()
    first, second = got["segments"]
    assert got["splits"] == {"history_changed": 1}
    split0 = len(backend.prompts[0]) + len(backend.model_.renderer.encode("run ls"))  # call 0's reply, eos last
    assert ran_by(rows(first)) == [0] * split0 + [1] * (len(first["token_ids"]) - 1 - split0)
    assert len(rows(first)) == len(first["token_ids"]) - 1
    split2 = len(backend.prompts[2]) + len(backend.model_.renderer.encode("run cat"))
    assert ran_by(rows(second)) == [2] * split2 + [3] * (len(second["token_ids"]) - 1 - split2)
    tokens = trial_tokens(got, max_tokens=4096)
    message = trajectory_message(tokens, trajectory_id="g/0", valid=True)
    assert message.routing == base64.b64decode(first["routing"])
    assert message.later_segments[0].routing == base64.b64decode(second["routing"])
    later = message.later_segments[0]
    assert (
        packed.routing_error(SHAPE, later.routing, len(later.prompt_token_ids), len(later.completion_token_ids)) is None
    )


async def test_a_dense_job_records_no_routing() -> None:
    backend = ScriptedBackend()
    backend.routing_shape = SHAPE  # the replica could, but the job does not ask
    app, http = app_of(backend)
    opened = (await http.post("/v1/sessions", headers=ADMIN)).json()
    await oa(app, key=opened["api_key"]).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": "hi"}]
    )
    got = (await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers=ADMIN)).json()
    assert got["routing_shape"] is None and got["segments"][0]["routing"] == ""
    assert not trajectory_message(trial_tokens(got, 4096)).HasField("routing_shape")


async def test_staged_trials_with_routing_assemble_into_the_groups_payload(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    backend = routed(VariedBackend())
    app, http = app_of(backend)
    parts, expected = [], []
    for kind, max_tokens in (("long", 120), ("dropped", 4096), ("two_segments", 4096), ("silent", 4096)):
        opened = await http.post(
            "/v1/sessions", headers=ADMIN, json={"staging": staging(redis_server, f"{JOB}/g/{kind}", max_tokens)}
        )
        session_id = opened.json()["session_id"]
        await record(app, backend, session_id, kind)
        reply = StagedTrial.parse((await http.post(f"/v1/sessions/{session_id}/stage", headers=ADMIN)).content)
        document = TrajectoryDocument.parse(
            (await http.get(f"/v1/sessions/{session_id}/trajectory", headers=ADMIN)).content
        )
        tokens = trial_tokens(document, max_tokens)
        assert reply.staged
        if kind == "silent":
            parts.append(None)
            expected.append(common_pb2.Trajectory(trajectory_id=f"{JOB}/g/{kind}"))
            continue
        assert all(s.routing for s in tokens.segments)
        message = trajectory_message(tokens, trajectory_id=f"{JOB}/g/{kind}")
        assert client.get(reply.part_key) == packed.pack([message])
        assert client.get(reply.part_key)[3] == packed.VERSION  # a routed part: payload version 2
        parts.append(reply.part_key)
        expected.append(message)

    advertised = staging(redis_server, "", 0)["data_plane"]
    plane = await DataPlane.connect(buffer_pb2.GetDataPlaneResponse.FromString(base64.b64decode(advertised)))
    assert plane is not None
    key, size = await assemble(plane, JOB, "g", parts)
    assembled = client.get(key)
    assert assembled == packed.pack(expected) and size == len(assembled)  # version 2, byte for byte
    metadata, _ = packed.split(common_pb2.Group(group_id="g", job_id=JOB, trajectories=expected))
    group = training_group(metadata, assembled)
    for sample, message in zip(group.samples[:3], expected[:3], strict=True):
        assert sample.routing.tobytes() == message.routing
        for later, segment in zip(sample.later_segments, message.later_segments, strict=True):
            assert later.routing.tobytes() == segment.routing
    assert len(expected[2].later_segments) == 1  # the edited history's segment came with its own routing
    await plane.close()


async def test_a_budgeted_reply_has_its_first_calls_rows_then_the_answer_calls() -> None:
    backend = routed(ScriptedBackend(build_thinking_tokenizer(), reasoning=True, limits=True))
    backend.script = ["<think>long long reasoning</think>never", "the answer"]
    app, http = app_of(backend)
    opened = (await http.post("/v1/sessions", headers=ADMIN)).json()
    await an(app, key=opened["api_key"]).messages.create(
        model="job-1",
        max_tokens=40,
        messages=[{"role": "user", "content": "q"}],
        thinking={"type": "enabled", "budget_tokens": 12},
    )
    got = (await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers=ADMIN)).json()
    [segment] = got["segments"]
    [completion] = segment["turns"][0]["completions"]
    assert completion["forced"]  # the budget ran out: the endpoint wrote the closing tag, a second call answered
    prompt = len(backend.prompts[0])
    routing = rows(segment)
    assert len(routing) == len(segment["token_ids"]) - 1
    # Call 0 ran the prompt and the 12 reasoning tokens but the last; call 1 ran that one, the forced tag and
    # the answer but its last token.
    assert ran_by(routing) == [0] * (prompt + 11) + [1] * (len(routing) - prompt - 11)


def test_a_recording_whose_routing_does_not_fit_its_tokens_is_a_contract_error() -> None:
    segment = {"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -1.0, -1.0]}
    segment["weight_versions"] = [-1, 0, 0]
    shape = {"moe_layers": 2, "top_k": 2, "num_experts": 256}
    fits = base64.b64encode(rows_of(2)).decode()
    assert trial_tokens({"segments": [{**segment, "routing": fits}], "routing_shape": shape}, 64).segments[0].routing
    for routing, recorded_shape in ((base64.b64encode(rows_of(3)).decode(), shape), (fits, None), ("%%", shape)):
        with pytest.raises(ContractError, match="routing"):
            trial_tokens({"segments": [{**segment, "routing": routing}], "routing_shape": recorded_shape}, 64)


def rows_of(n: int) -> bytes:
    return bytes(4 * n)
