"""SandboxService as a real server process: every RPC, exact status codes for bad input, clean SIGTERM.

The tests are synchronous (start_service blocks until SERVING); each drives
its client calls with asyncio.run.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect

PASSED = common_pb2.VERDICT_STATUS_PASSED
FAILED = common_pb2.VERDICT_STATUS_FAILED
TIMEOUT = common_pb2.VERDICT_STATUS_TIMEOUT

SMALL_CEILINGS = {
    "DOCKYARD_SANDBOX_MAX_TIMEOUT_SECONDS": "30",
    "DOCKYARD_SANDBOX_MAX_MEMORY_MB": "1024",
    "DOCKYARD_SANDBOX_MAX_CPU_SECONDS": "30",
    "DOCKYARD_SANDBOX_MAX_OUTPUT_BYTES": "65536",
}


def run_tests_request(program: str, tests: list[str], **limits) -> sandbox_pb2.RunTestsRequest:
    return sandbox_pb2.RunTestsRequest(program=program, tests=tests, limits=sandbox_pb2.Limits(**limits))


async def every_rpc(address: str) -> None:
    async with connect(address) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)

        reply = await stub.Execute(
            sandbox_pb2.ExecuteRequest(files={"main.py": "print('ok')"}, command=["python", "main.py"]), timeout=30
        )
        assert (reply.verdict.status, reply.verdict.stdout, reply.verdict.tests_total) == (PASSED, "ok\n", 1)

        program = "def double(x):\n    return 2 * x\n"
        reply = await stub.RunTests(run_tests_request(program, ["assert double(2) == 4"]), timeout=30)
        assert (reply.verdict.status, reply.verdict.tests_passed, reply.verdict.tests_total) == (PASSED, 1, 1)
        reply = await stub.RunTests(run_tests_request(program, ["assert double(2) == 4", "assert double(3) == 5"]))
        assert (reply.verdict.status, reply.verdict.tests_passed, reply.verdict.tests_total) == (FAILED, 1, 2)

        reply = await stub.RunTests(run_tests_request("while True:\n    pass\n", ["assert True"], timeout_seconds=1.0))
        assert reply.verdict.status == TIMEOUT

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(instance_id="x", patch="diff"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task_set" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # no task root configured
            await stub.ScorePatch(sandbox_pb2.ScorePatchRequest(task_set="t", instance_id="x", patch="d"), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "DOCKYARD_SANDBOX_TASK_ROOT" in err.value.details()


def test_every_rpc_answers_and_sigterm_exits_zero(start_service):
    service = start_service("sandbox", SMALL_CEILINGS)
    asyncio.run(every_rpc(service.address))
    assert service.stop() == 0


BAD_REQUESTS = [
    ("Execute", sandbox_pb2.ExecuteRequest(command=[]), "command"),
    ("Execute", sandbox_pb2.ExecuteRequest(command=[""]), "command"),
    ("Execute", sandbox_pb2.ExecuteRequest(files={"/etc/passwd": "x"}, command=["true"]), "files"),
    ("Execute", sandbox_pb2.ExecuteRequest(files={"../up.py": "x"}, command=["true"]), "files"),
    ("RunTests", run_tests_request("x = 1", []), "tests"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], timeout_seconds=-1), "limits.timeout_seconds"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], timeout_seconds=math.nan), "limits.timeout_seconds"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], timeout_seconds=31), "limits.timeout_seconds"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], memory_mb=-5), "limits.memory_mb"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], memory_mb=1025), "limits.memory_mb"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], cpu_seconds=math.nan), "limits.cpu_seconds"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], cpu_seconds=math.inf), "limits.cpu_seconds"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], max_output_bytes=65537), "limits.max_output_bytes"),
    ("RunTests", run_tests_request("x = 1", ["assert x"], max_output_bytes=-1), "limits.max_output_bytes"),
]


async def bad_inputs(address: str) -> None:
    async with connect(address) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        for method, request, field in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(stub, method)(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, request)
            assert field in err.value.details(), (field, err.value.details())
        reply = await stub.RunTests(run_tests_request("x = 1", ["assert x == 1"]), timeout=30)
        assert reply.verdict.status == PASSED


def test_bad_input_is_invalid_argument_and_the_service_keeps_serving(start_service):
    service = start_service("sandbox", SMALL_CEILINGS)
    asyncio.run(bad_inputs(service.address))
    assert service.stop() == 0


async def execute(address: str, request: sandbox_pb2.ExecuteRequest) -> sandbox_pb2.ExecuteResponse:
    async with connect(address) as channel:
        return await sandbox_pb2_grpc.SandboxServiceStub(channel).Execute(request, timeout=30)


def test_code_cannot_see_the_service_environment(start_service):
    service = start_service("sandbox", {"DOCKYARD_SECRET": "hunter2"})
    request = sandbox_pb2.ExecuteRequest(command=["sh", "-c", 'env; test -z "$DOCKYARD_SECRET"'])
    reply = asyncio.run(execute(service.address, request))
    assert reply.verdict.status == PASSED, reply.verdict
    assert "hunter2" not in reply.verdict.stdout
    assert "DOCKYARD_SECRET" not in reply.verdict.stdout
