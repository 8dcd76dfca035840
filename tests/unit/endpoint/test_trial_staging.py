"""The endpoint stages a finished trial's tokens where the service token said when it opened the session:
exactly trial_tokens' cut of the recording, packed as one trajectory, and nowhere anyone else names."""

from __future__ import annotations

import base64

import httpx
import redis

from dockyard.agents.contract import StagedTrial, TrajectoryDocument
from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.experience import payload as packed
from dockyard.experience.data_plane import staging_base
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from tests.unit.endpoint.scripted import TOKEN
from tests.unit.endpoint.trials import VariedBackend, record

JOB, PREFIX = "job-1", "dockyard:buffer"


def plane(url: str) -> str:
    advertised = buffer_pb2.GetDataPlaneResponse(
        redis_url=url, key_prefix=PREFIX, staging_ttl_seconds=60, max_trajectory_tokens=65536, max_group_bytes=1 << 24
    )
    return base64.b64encode(advertised.SerializeToString()).decode()


def staging(url: str, trajectory_id: str, max_tokens: int) -> dict:
    return {"data_plane": plane(url), "job_id": JOB, "trajectory_id": trajectory_id, "max_tokens": max_tokens}


def endpoint() -> tuple[httpx.AsyncClient, VariedBackend, object]:
    backend = VariedBackend()
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint"), backend, app


ADMIN = {"x-api-key": TOKEN}


async def test_the_stage_route_stages_exactly_the_cut_tokens_of_the_trial(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    http, backend, app = endpoint()
    for kind, max_tokens in (("long", 120), ("dropped", 4096), ("two_segments", 4096)):
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
        expected = packed.pack([trajectory_message(tokens, trajectory_id=f"{JOB}/g/{kind}")])
        assert reply.staged and reply.part_key.startswith(staging_base(PREFIX, JOB) + f"{JOB}/g/{kind}:")
        assert client.get(reply.part_key) == expected and reply.part_bytes == len(expected)
        assert 0 < client.ttl(reply.part_key) <= 60
        assert (reply.segments, reply.sampled_tokens, reply.total_tokens, reply.truncated) == (
            len(tokens.segments),
            tokens.sampled_tokens,
            tokens.total_tokens,
            tokens.truncated,
        )
        assert reply.turns == document.turns and reply.invalid_actions == document.invalid_actions
        assert reply.conversation == [{"messages": s.messages, "tools": s.tools} for s in document.segments]
        assert reply.truncated == (kind == "long") and reply.segments == (2 if kind == "two_segments" else 1)
        assert reply.invalid_actions == (kind == "dropped")


async def test_a_trial_without_tokens_stages_nothing_and_an_unreachable_plane_says_so(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    http, backend, app = endpoint()
    opened = await http.post("/v1/sessions", headers=ADMIN, json={"staging": staging(redis_server, "t/0", 4096)})
    silent = StagedTrial.parse(
        (await http.post(f"/v1/sessions/{opened.json()['session_id']}/stage", headers=ADMIN)).content
    )
    assert (silent.staged, silent.part_key, silent.segments, silent.sampled) == (True, "", 0, False)
    assert client.dbsize() == 0

    # A data plane this endpoint cannot reach: the reply says so (the caller reads the trajectory), nothing lost.
    opened = await http.post(
        "/v1/sessions", headers=ADMIN, json={"staging": staging("redis://127.0.0.1:9/0", "t/1", 4096)}
    )
    session_id = opened.json()["session_id"]
    await record(app, backend, session_id, "dropped")
    reply = StagedTrial.parse((await http.post(f"/v1/sessions/{session_id}/stage", headers=ADMIN)).content)
    assert (reply.staged, reply.part_key, reply.segments) == (False, "", 1)
    assert (await http.get(f"/v1/sessions/{session_id}/trajectory", headers=ADMIN)).status_code == 200


async def test_only_the_service_token_says_where_a_session_stages(redis_server: str) -> None:
    http, backend, app = endpoint()
    opened = (await http.post("/v1/sessions", headers=ADMIN)).json()  # no staging
    key = {"x-api-key": opened["api_key"]}
    # The session's own key may neither open a session that stages nor make its session stage.
    refused = await http.post("/v1/sessions", headers=key, json={"staging": staging(redis_server, "t/0", 10)})
    assert refused.status_code == 403
    assert (await http.post(f"/v1/sessions/{opened['session_id']}/stage", headers=key)).status_code == 403
    # A session opened without staging stages nothing, even for the token.
    unstaged = await http.post(f"/v1/sessions/{opened['session_id']}/stage", headers=ADMIN)
    assert unstaged.status_code == 400 and "without staging" in unstaged.json()["error"]["message"]
    # A data plane that is not a GetDataPlane answer is refused when the session opens, not at its end.
    bad = staging(redis_server, "t/0", 10) | {"data_plane": "not base64!"}
    assert (await http.post("/v1/sessions", headers=ADMIN, json={"staging": bad})).status_code == 400
    unknown = await http.post("/v1/sessions", headers=ADMIN, json={"staging": staging(redis_server, "t/0", 10), "x": 1})
    assert unknown.status_code == 422
    assert (await http.post("/v1/sessions/nope/stage", headers=ADMIN)).status_code == 404
    # What a session stages is fixed by its opener: nothing its key sends reaches it.
    store = app.state.store
    assert store.get(opened["session_id"]).staging is None
