"""A real stack serving the tiny job to the policy endpoint's integration tests (one per test module).

    served_job(tmp, replicas) ──LocalStack(endpoint=True, `dockyard up`'s stack)──CreateJob(tiny_expr,
        a random model, room for a tools line)──wait_until_replicas_serve──> ServedJob(base URL, job id,
        stack, config), stopped when the module's fixture ends

The job trains on while it is served (GRPO steps on its own tasks): its weight version moves under
the clients, as a real job's does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import MasterConfig, load_config
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.client import connect
from dockyard.stack import LocalStack
from tests.conftest import REPO_ROOT

TOKEN = "endpoint-test-token"


@dataclass(frozen=True)
class ServedJob:
    base: str  # the endpoint's base URL, http://host:port
    job_id: str
    stack: LocalStack
    config: MasterConfig  # the job's resolved config


@contextmanager
def served_job(logs: Path, runs: Path, replicas: int) -> Iterator[ServedJob]:
    """A stack of `replicas` rollout replicas and the endpoint, serving the tiny job until the block ends."""
    stack = LocalStack(
        logs, free_ports=True, endpoint=True, rollout_replicas=replicas, extra_env={"DOCKYARD_AUTH_TOKEN": TOKEN}
    )
    stack.start()
    try:
        cfg = load_config(
            REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml",
            [
                "policy.model_name=null",
                "policy.bootstrap=null",
                "policy.model.max_position_embeddings=512",  # room for a tools line
                "policy.generation.prefix_cache_tokens=4096",
                "grpo.max_num_steps=100000",
                f"logger.log_dir={runs}",
            ],
        )

        async def create() -> str:
            async with connect(stack.address("coordinator"), auth=AuthSettings(auth_token=TOKEN)) as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job
                return job.job_id

        job_id = asyncio.run(create())
        wait_until_replicas_serve(stack, job_id, replicas)
        yield ServedJob(f"http://{stack.address('endpoint')}", job_id, stack, cfg)
    finally:
        stack.stop()


def wait_until_replicas_serve(stack: LocalStack, job_id: str, replicas: int) -> None:
    """Until `replicas` replicas hold the job's policy and the endpoint serves it."""

    async def all_hold() -> None:
        async with connect(stack.address("coordinator"), auth=AuthSettings(auth_token=TOKEN)) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            deadline = time.monotonic() + 240
            while True:
                members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
                if sum(job_id in m.weight_versions for m in members) == replicas:
                    return
                assert time.monotonic() < deadline, members
                await asyncio.sleep(1)

    asyncio.run(all_hold())
    base = f"http://{stack.address('endpoint')}"
    headers = {"authorization": f"Bearer {TOKEN}"}
    body = {"model": job_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 180
    while True:
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
        if reply.status_code == 200:
            return
        assert reply.status_code in (404, 503), reply.text
        assert time.monotonic() < deadline, reply.text
        time.sleep(1)
