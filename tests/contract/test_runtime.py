"""What every service gets from dockyard.rpc: graceful SIGTERM, JSON logs with ids, reflection."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect


def test_sigterm_reports_not_serving_then_finishes_in_flight_calls(start_service) -> None:
    sandbox = start_service("sandbox", {"DOCKYARD_SANDBOX_DRAIN_SECONDS": "1.5"})

    async def scenario() -> tuple[list[str], sandbox_pb2.RunTestsResponse]:
        async with connect(sandbox.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            slow = asyncio.ensure_future(
                stub.RunTests(
                    sandbox_pb2.RunTestsRequest(
                        program="import time\ntime.sleep(1.5)\ndef f(x):\n    return x\n",
                        tests=["assert f(2) == 2"],
                        limits=sandbox_pb2.Limits(timeout_seconds=10),
                    )
                )
            )
            await asyncio.sleep(0.3)
            sandbox.proc.send_signal(signal.SIGTERM)
            seen = []
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                await asyncio.sleep(0.1)
            return seen, await slow

    seen, reply = asyncio.run(scenario())
    assert "NOT_SERVING" in seen
    assert reply.verdict.tests_passed == 1, reply
    assert sandbox.stop() == 0


def test_logs_are_json_lines_with_request_and_job_ids(start_service) -> None:
    buffer = start_service("buffer")

    async def call() -> None:
        async with connect(buffer.address) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            try:
                await stub.AckGroups(
                    buffer_pb2.AckGroupsRequest(job_id="job-7", group_ids=["missing"]),
                    metadata=(("x-request-id", "req-42"),),
                )
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(call())
    assert buffer.stop() == 0
    records = [json.loads(line) for line in buffer.logs().splitlines() if line.startswith("{")]
    assert records, buffer.logs()
    refused = [r for r in records if r.get("event") == "rpc refused"]
    assert refused and refused[0]["job_id"] == "job-7" and refused[0]["request_id"] == "req-42"
    assert refused[0]["service"] == "buffer" and refused[0]["code"] == "NOT_FOUND"
