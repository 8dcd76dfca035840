"""An agent trial with the buffer's data plane (real redis-server, a fake endpoint that stages as the real one
does): its session is opened with where to stage, its tokens stay out of the coordinator, and a part staged
for a trial the coordinator then masks (a scaffold error) is deleted."""

from __future__ import annotations

import json

import httpx
import redis

from dockyard.agents.contract import StagedTrial, TrajectoryDocument, TrialStaging
from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import load_config
from dockyard.experience import payload as packed
from dockyard.experience.agent_trial import stage_part
from dockyard.experience.data_plane import DataPlane
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.fleet import Fleet
from services.coordinator.task_stream import load_tasks
from tests.unit.coordinator.test_scaffold_errors import CONFIG, Ends, FakeEndpoint, FakeSandbox, passed


class StagingEndpoint(FakeEndpoint):
    """The fake endpoint, plus what the real one does with staging: kept from the session's opening, and
    POST .../stage cuts, packs and stages the recording there (services/endpoint/staging.py)."""

    def __init__(self, plane: DataPlane) -> None:
        super().__init__()
        self.plane, self.staging, self.parts = plane, {}, []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/sessions":
            reply = super().handle(request)
            body = json.loads(request.content or b"null")
            self.staging[reply.json()["session_id"]] = TrialStaging(**body["staging"]) if body else None
            return reply
        if not path.endswith("/stage"):
            return super().handle(request)
        session = path.split("/")[3]
        staging = self.staging[session]
        document = TrajectoryDocument.parse(
            super().handle(httpx.Request("GET", f"/v1/sessions/{session}/trajectory")).content
        )
        tokens = trial_tokens(document, staging.max_tokens)
        key, size = "", 0
        if tokens.segments:
            key, size = await stage_part(
                self.plane, staging.job_id, trajectory_message(tokens, trajectory_id=staging.trajectory_id)
            )
            self.parts.append(key)
        reply = StagedTrial(
            session_id=session,
            status=document.status,
            error="",
            turns=document.turns,
            invalid_actions=0,
            sampled=bool(tokens.segments),
            conversation=[],
            staged=True,
            part_key=key,
            part_bytes=size,
            segments=len(tokens.segments),
            sampled_tokens=tokens.sampled_tokens,
            total_tokens=tokens.total_tokens,
            truncated=tokens.truncated,
            weight_version=tokens.weight_version,
        )
        return httpx.Response(200, json=reply.to_json())


async def trials_with_staging(redis_server: str, ends: Ends):
    limits = buffer_pb2.GetDataPlaneResponse(
        redis_url=redis_server, key_prefix="dockyard:buffer", staging_ttl_seconds=60, max_trajectory_tokens=65536
    )
    plane = await DataPlane.connect(limits)
    config = load_config(CONFIG, ["env.scaffold.answer_file=answer.txt"])
    endpoint = StagingEndpoint(plane)
    sandbox = FakeSandbox(endpoint, [ends])
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, sandbox))
    fleet.register("sandbox", "sandbox", "127.0.0.1:1")
    trials = AgentTrials(
        "job",
        config,
        fleet,
        passed,
        sandbox_pb2.Limits(timeout_seconds=10),
        endpoint_address="127.0.0.1:9",
        token="token",
        max_regenerations=0,
        wait_timeout=5.0,
        transport=httpx.MockTransport(endpoint.handle),
        plane=lambda: plane,
    )
    return config, trials, endpoint, plane


async def test_a_trial_opened_with_staging_keeps_its_tokens_out_of_the_coordinator(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    config, trials, endpoint, plane = await trials_with_staging(redis_server, Ends(answer=b"f(x)=x+1"))
    task = load_tasks(config, "train")[0]
    try:
        [trial] = await trials.group(task, "job/g0", 0, 1, config.policy.generation)
        # Validation trials are never put: their sessions name no data plane.
        await trials.validation_trial(task, "job/val/0", config.policy.generation.model_copy(update={"temperature": 0}))
    finally:
        await trials.close()
    staging = endpoint.staging["s1"]
    assert (staging.job_id, staging.trajectory_id, staging.max_tokens) == (
        "job",
        "job/g0/0",
        config.grpo.max_trial_tokens,
    )
    assert endpoint.staging["s2"] is None
    assert not packed.has_tokens(trial.trajectory) and trial.trajectory.sampled_tokens == 2
    assert trial.received_bytes == 0 and trial.part is not None and trial.part.key == endpoint.parts[0]
    recorded = FakeEndpoint.handle(endpoint, httpx.Request("GET", "/v1/sessions/s1/trajectory")).content
    tokens = trial_tokens(TrajectoryDocument.parse(recorded), config.grpo.max_trial_tokens)
    assert client.get(trial.part.key) == packed.pack([trajectory_message(tokens, trajectory_id="job/g0/0")])
    await plane.close()


async def test_a_part_staged_for_a_trial_masked_as_a_scaffold_error_is_deleted(redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    garbage = Ends(answer=b"\xff\xfe\x00\x01 binary", stderr="wrote answer")  # it called the model, then failed
    config, trials, endpoint, plane = await trials_with_staging(redis_server, garbage)
    task = load_tasks(config, "train")[0]
    try:
        [trial] = await trials.group(task, "job/g0", 0, 1, config.policy.generation)
    finally:
        await trials.close()
    assert trial.scaffold_error and trial.part is None
    assert len(endpoint.parts) == 1 and client.exists(endpoint.parts[0]) == 0  # staged, then deleted
    await plane.close()
