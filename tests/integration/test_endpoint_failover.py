"""Sticky sessions across two real rollout replicas, and a session that goes on when its replica dies.

A LocalStack with two rollout processes and the endpoint serves the tiny job (prefix cache on). Sessions
spread over both replicas; each session's calls stay on its replica (the job trains meanwhile, so a weight
update may empty a cache between two turns: what the cache saves is measured in bench/routing.py); the
replica holding a session is killed (SIGKILL) and the session's next call is served by the other one, its
trajectory still whole and "ok".
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

TOKEN = "failover-test-token"


def test_sessions_stick_spread_and_move_when_their_replica_dies(tmp_path) -> None:
    stack = LocalStack(
        tmp_path / "logs",
        free_ports=True,
        endpoint=True,
        rollout_replicas=2,
        extra_env={"DOCKYARD_AUTH_TOKEN": TOKEN},
    )
    stack.start()
    try:
        cfg = load_config(
            REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
            [
                "policy.model_name=null",
                "policy.bootstrap=null",
                "policy.model.max_position_embeddings=512",
                "policy.generation.prefix_cache_tokens=4096",
                "grpo.max_num_steps=100000",
                f"logger.log_dir={tmp_path / 'runs'}",
            ],
        )

        async def create() -> tuple[str, coordinator_pb2.ListMembersResponse]:
            async with connect(stack.address("coordinator"), auth=AuthSettings(auth_token=TOKEN)) as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job
                deadline = time.monotonic() + 240
                while True:  # until both replicas hold the job's policy
                    members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
                    if sum(job.job_id in m.weight_versions for m in members) == 2:
                        return job.job_id
                    assert time.monotonic() < deadline, members
                    await asyncio.sleep(1)

        job = asyncio.run(create())
        base, headers = f"http://{stack.address('endpoint')}", {"authorization": f"Bearer {TOKEN}"}
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        histories: dict[str, list] = {}

        def turn(session: str) -> None:
            messages = histories.setdefault(session, [])
            messages.append({"role": "user", "content": f"f({len(messages)})=?"})
            reply = client.chat.completions.create(
                model=job, messages=messages, max_tokens=6, seed=1, extra_headers={"X-Dockyard-Session": session}
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})

        for session in ("s1", "s2", "s3", "s4"):
            turn(session)
        routing = httpx.get(f"{base}/v1/routing", headers=headers).json()
        assert {name: r["sessions"] for name, r in routing["replicas"].items()} == {"rollout-1": 2, "rollout-2": 2}
        for session in ("s1", "s2", "s3", "s4"):
            turn(session)
        routing = httpx.get(f"{base}/v1/routing", headers=headers).json()
        assert routing["moved_sessions"] == 0 and routing["retried_calls"] == 0
        assert all(r["kv_capacity_tokens"] == 4096 for r in routing["replicas"].values()), routing

        stack.kill("rollout-1")
        for session in ("s1", "s2", "s3", "s4"):
            turn(session)  # the sessions of rollout-1 go on on rollout-2
        routing = httpx.get(f"{base}/v1/routing", headers=headers).json()
        assert routing["moved_sessions"] == 2 and routing["replicas"]["rollout-2"]["sessions"] == 4, routing
        for session in ("s1", "s2", "s3", "s4"):
            trajectory = httpx.get(f"{base}/v1/sessions/{session}/trajectory", headers=headers).json()
            assert trajectory["status"] == "ok" and trajectory["turns"] == 3, trajectory
    finally:
        stack.stop()
