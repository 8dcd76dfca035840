"""Backpressure: with every slot busy and the queue full, the sandbox answers RESOURCE_EXHAUSTED at once."""

from __future__ import annotations

import asyncio

import grpc

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from tests.conftest import expect_code

PASSED = common_pb2.VERDICT_STATUS_PASSED


def sleeper(seconds: float) -> sandbox_pb2.ExecuteRequest:
    return sandbox_pb2.ExecuteRequest(command=["sleep", str(seconds)])


async def fill_then_overflow(address: str) -> None:
    async with connect(address) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        running = asyncio.ensure_future(stub.Execute(sleeper(3), timeout=30))
        await asyncio.sleep(0.5)  # it holds the only slot
        queued = asyncio.ensure_future(stub.Execute(sleeper(0.1), timeout=30))
        await asyncio.sleep(0.5)  # it holds the only queue place

        loop = asyncio.get_running_loop()
        start = loop.time()
        await expect_code(stub.Execute(sleeper(0.1), timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "retry")
        program = sandbox_pb2.RunTestsRequest(program="x = 1", tests=["assert x == 1"])
        await expect_code(stub.RunTests(program, timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_queued=1")
        assert loop.time() - start < 1.5, "a full sandbox must refuse at once, not after the queue drains"

        # Nothing accepted was lost, and once the queue drains the service takes work again.
        assert (await running).verdict.status == PASSED
        assert (await queued).verdict.status == PASSED
        reply = await stub.RunTests(program, timeout=30)
        assert reply.verdict.status == PASSED


def test_a_full_queue_is_resource_exhausted_and_drains(start_service):
    service = start_service("sandbox", {"DOCKYARD_SANDBOX_MAX_CONCURRENCY": "1", "DOCKYARD_SANDBOX_MAX_QUEUED": "1"})
    asyncio.run(fill_then_overflow(service.address))
