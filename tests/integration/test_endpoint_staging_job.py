"""An agent job on real processes (LocalStack with the policy endpoint) with the Redis buffer: the endpoint
stages every trial's tokens in the data plane and the coordinator carries metadata only; with the buffer in
memory, the trials' tokens come to the coordinator as before. Both train, and the books of the run add up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT
from tests.integration.books import assert_accounted

pytestmark = pytest.mark.slow

TOKEN = "staging-test-token"
AGENT = [
    "policy.model_name=null",
    "policy.bootstrap=null",
    "policy.generation.max_new_tokens=24",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_rollout_turns=3",
    "grpo.max_num_steps=2",
    "grpo.max_trajectory_age_steps=0",
    "checkpointing.enabled=false",
]


def run_job(stack: LocalStack, overrides: list[str], timeout: float = 420.0) -> coordinator_pb2.Job:
    cfg = load_config(REPO_ROOT / "examples" / "configs" / "tiny_agent.yaml", AGENT + overrides)

    async def go() -> coordinator_pb2.Job:
        async with connect(stack.address("coordinator"), auth=AuthSettings(auth_token=TOKEN)) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            request = coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml())
            job_id = (await stub.CreateJob(request)).job.job_id
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id))).job
                if job.state in (
                    coordinator_pb2.JOB_STATE_SUCCEEDED,
                    coordinator_pb2.JOB_STATE_FAILED,
                    coordinator_pb2.JOB_STATE_CANCELLED,
                ):
                    return job
                assert asyncio.get_running_loop().time() < deadline, f"job stuck at step {job.step}, phase {job.phase}"
                await asyncio.sleep(0.5)

    return asyncio.run(go())


@pytest.mark.parametrize("backend", ["redis", "memory"])
def test_agent_trials_leave_from_the_endpoint_with_a_data_plane(tmp_path: Path, backend: str, request) -> None:
    env = {"DOCKYARD_AUTH_TOKEN": TOKEN}
    if backend == "redis":
        url = request.getfixturevalue("redis_server")
        redis.Redis.from_url(url).flushdb()
        env |= {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": url}
    stack = LocalStack(tmp_path / "logs", free_ports=True, endpoint=True, extra_env=env)
    stack.start()
    try:
        job = run_job(stack, [f"logger.log_dir={tmp_path}"])
    finally:
        stack.stop()
    assert job.state == coordinator_pb2.JOB_STATE_SUCCEEDED, job.message
    books = assert_accounted(tmp_path / job.job_id, max_age=0)
    assert [line["step"] for line in books["ledger"]] == [1, 2]
    final = [r for r in books["records"] if r["kind"] == "buffer"][-1]
    carried, staged = (
        final["coordinator_received_trial_arrays_bytes"],
        final["coordinator_received_endpoint_staged_bytes"],
    )
    print(backend, {k: v for k, v in final.items() if k.startswith(("coordinator_received_", "buffer_sent_"))})
    if backend == "redis":
        # Not one trial's token array reached the coordinator: each went endpoint -> Redis -> trainer.
        assert carried == 0 and staged > 0
        assert final["buffer_sent_payload_bytes"] == final["buffer_sent_staged_bytes"] == 0
        assert final["buffer_sent_rollout_staged_bytes"] > 0  # the assembled groups' payloads, committed by key
    else:
        assert carried > 0 and staged == 0
        assert final["buffer_sent_payload_bytes"] > 0 and final["buffer_sent_rollout_staged_bytes"] == 0
