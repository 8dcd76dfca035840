"""Agent groups through the data plane, against a real buffer process on a real redis-server: the trainer's
batch is the same, bit for bit, whether the coordinator carried the trials' tokens or the endpoint staged them.

The same trials are recorded three times by endpoint apps over identical scripted replicas (the same
tokens and logprobs): A is the coordinator-carried path (GET trajectory, trial_tokens here, JobBuffer.put
packs and stages the group); B is the endpoint-staged path (each session opened with staging, the parts
assembled in Redis by StagedPayloads, PutGroup with metadata only); C is B with one trial whose endpoint
could not reach the data plane (its tokens come here and the coordinator stages that part). The budget
cut, a dropped reply (mask 0), an edited history (two segments) and a trial without tokens are in each.
"""

from __future__ import annotations

import base64

import httpx
import redis

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.config import SamplingConfig
from dockyard.rpc.client import connect
from services.coordinator.endpoint_sessions import EndpointSessions, Recording, staging_for
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.staged_payloads import StagedPayloads
from services.coordinator.trials import Trial
from services.endpoint.app import create_app
from services.endpoint.settings import EndpointSettings
from services.trainer.consumer import BufferConsumer
from services.trainer.ledger import TrainedLedger
from services.trainer.requests import training_group
from tests.unit.endpoint.scripted import TOKEN
from tests.unit.endpoint.trials import KINDS, VariedBackend, record

GROUP, MAX_TOKENS = "s1/g0", 150  # the "long" trial passes the budget: it is cut


def trial(i: int, r: Recording) -> Trial:
    """The trial as AgentTrials makes it from its recording (the same fields on every path)."""
    if not r.segments:
        error = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message="no sampled token")
        return Trial(
            common_pb2.Trajectory(trajectory_id=f"{GROUP}/{i}", valid=False, verdict=error, finish_reason="error")
        )
    verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=i, tests_total=4)
    trajectory = r.message(
        trajectory_id=f"{GROUP}/{i}",
        completion_text=f"answer {i}",
        verdict=verdict,
        finish_reason="tokens" if r.truncated else "stop",
        num_turns=r.turns,
        invalid_actions=r.invalid_actions,
        valid=True,
        reward=i / 4,
    )
    return Trial(trajectory, r.conversation, part=r.part, received_bytes=r.received_bytes)


class RecordedAgent:
    """AgentTrials.group over trials recorded beforehand."""

    def __init__(self, trials: list[Trial]) -> None:
        self.trials, self.regenerated_groups = trials, 0

    async def group(self, task, group_id, seed, n, sampling) -> list[Trial]:
        return self.trials


async def recorded(job_id: str, plane, unreachable: set[int] = frozenset()) -> list[Recording]:
    """The KINDS trials in fresh sessions of a fresh endpoint (identical replica), read back as the coordinator
    reads them: staged where `plane` is given (sessions in `unreachable` named a data plane it cannot reach)."""
    backend = VariedBackend()
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)
    sessions = EndpointSessions("http://endpoint", TOKEN, httpx.ASGITransport(app=app))
    out = []
    for i, kind in enumerate(KINDS):
        staging = staging_for(plane, job_id, f"{GROUP}/{i}", MAX_TOKENS)
        if staging is not None and i in unreachable:
            away = buffer_pb2.GetDataPlaneResponse(redis_url="redis://127.0.0.1:9/0", key_prefix="dockyard:buffer")
            staging.data_plane = base64.b64encode(away.SerializeToString()).decode()
        session_id, _ = await sessions.open(False, staging)
        await record(app, backend, session_id, kind)
        out.append(await sessions.recording(session_id, MAX_TOKENS, staged=staging is not None))
    await sessions.close()
    return out


def group(job_id: str, trials: list[Trial]) -> common_pb2.Group:
    versions = [t.trajectory.weight_version for t in trials if t.trajectory.valid]
    for t in trials:
        if not t.trajectory.valid:  # a trial without tokens takes the group's version (Collector._group)
            t.trajectory.weight_version = min(versions)
    return common_pb2.Group(
        group_id=GROUP,
        job_id=job_id,
        task_id="t0",
        prompt="fix it",
        weight_version=min(versions),
        trajectories=[t.trajectory for t in trials],
    )


async def test_the_trainers_batch_is_the_same_whether_the_coordinator_carried_the_trials_or_the_endpoint_staged_them(
    start_service, redis_server: str, tmp_path
) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    buffer = start_service("buffer", {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": redis_server})
    leased, received, sent = {}, {}, {}
    async with connect(buffer.address, default_timeout=30) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        for job_id in ("job-a", "job-b", "job-c"):
            job_buffer = JobBuffer(stub, job_id, max_groups=8, max_age_steps=4)
            await job_buffer.open(rewind_to=7)  # the scripted replica samples at version 7
            plane = job_buffer.data_plane
            assert plane is not None
            staged = StagedPayloads(job_buffer)
            if job_id == "job-a":  # the coordinator-carried path: the trials' arrays come here, put whole
                trials = [trial(i, r) for i, r in enumerate(await recorded(job_id, None))]
                await job_buffer.put(group(job_id, trials))
                received[job_id] = {"trial_arrays": sum(t.received_bytes for t in trials), "endpoint_staged": 0}
            else:
                recordings = await recorded(job_id, plane, unreachable={1} if job_id == "job-c" else set())
                agent = RecordedAgent([trial(i, r) for i, r in enumerate(recordings)])
                trials, payload = await staged.agent_trials(agent, None, GROUP, 0, len(KINDS), SamplingConfig(), 0)
                assert payload is not None and all(t.part is None for t in trials)  # the parts are in the payload
                metadata = group(job_id, trials)
                assert not any(t.prompt_token_ids or t.later_segments for t in metadata.trajectories)
                reply = await job_buffer.put(metadata, staged=payload)
                assert not reply.duplicate and not reply.dropped_stale
                received[job_id] = staged.received()
            sent[job_id] = job_buffer.sent()
            consumer = BufferConsumer(stub, "trainer-0", job_id, TrainedLedger(tmp_path / job_id), ack_timeout=10)
            [got] = (await consumer.lease(7, 1)).groups
            leased[job_id] = got
            await job_buffer.close_plane()

    a, b, c = (leased[j] for j in ("job-a", "job-b", "job-c"))
    # The payload the trainer reads is the same bytes on every path; so are the metadata (less the job id).
    assert a.payload == b.payload == c.payload and len(a.payload) > 0
    for got in (a, b, c):
        got.group.job_id = ""
    assert a.group == b.group == c.group
    batch = training_group(a.group, a.payload)
    assert batch == training_group(b.group, b.payload) == training_group(c.group, c.payload)
    # What is trained is what was recorded: the cut, the dropped reply's mask, both segments, the empty trial.
    lengths = [len(s.later_segments) + 1 if s.prompt_ids else 0 for s in batch.samples]
    assert lengths == [1, 2, 1, 0]
    assert 0 in batch.samples[0].loss_mask and any(m == 1 for m in batch.samples[0].loss_mask)
    assert all(len(s.prompt_ids) + len(s.completion_ids) <= MAX_TOKENS for s in batch.samples)
    assert (
        batch.samples[2].prompt_ids
        and len(batch.samples[2].prompt_ids) + len(batch.samples[2].completion_ids) == MAX_TOKENS
    )

    # Payload bytes through the coordinator: all of them carried, none staged by the endpoint, one trial's in C.
    assert received["job-a"]["trial_arrays"] > 0 and received["job-a"]["endpoint_staged"] == 0
    assert received["job-b"]["trial_arrays"] == 0 and received["job-b"]["endpoint_staged"] > 0
    assert sent["job-b"]["staged"] == sent["job-b"]["payload"] == 0 and sent["job-b"]["rollout_staged"] == len(
        b.payload
    )
    assert 0 < received["job-c"]["trial_arrays"] < received["job-a"]["trial_arrays"]
    assert 0 < sent["job-c"]["staged"] < len(c.payload)  # the one part the coordinator staged itself
    assert sent["job-a"]["staged"] == len(a.payload)
    # Nothing is left staged: every part went into its group's payload, which the put took over.
    assert not list(client.scan_iter(match="dockyard:buffer:*:s:*"))
