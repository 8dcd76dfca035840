"""gRPC face of the sandbox: validates limits, calls the backend, returns verdicts.

Execute / RunTests --> resolve_limits (0 -> default; < 0, NaN, > ceiling -> INVALID_ARGUMENT)
                   --> Admission (max_concurrency running, max_queued waiting, else RESOURCE_EXHAUSTED)
                   --> SandboxBackend --> Outcome --> common.v1.Verdict
ScorePatch         --> UNIMPLEMENTED until the docker backend exists
"""

from __future__ import annotations

import math

import grpc

from dockyard.common.v1 import common_pb2
from dockyard.rpc.errors import InvalidArgument, Unimplemented
from dockyard.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.sandbox.admission import Admission
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend, Status
from services.sandbox.settings import SandboxSettings

_STATUS = {
    Status.PASSED: common_pb2.VERDICT_STATUS_PASSED,
    Status.FAILED: common_pb2.VERDICT_STATUS_FAILED,
    Status.ERROR: common_pb2.VERDICT_STATUS_ERROR,
    Status.TIMEOUT: common_pb2.VERDICT_STATUS_TIMEOUT,
}


def resolve_limits(limits: sandbox_pb2.Limits, settings: SandboxSettings) -> ResourceLimits:
    """Fill 0 fields with the defaults; refuse negative, NaN and above-ceiling values, naming the field."""

    def pick(field: str, default: float, ceiling: float) -> float:
        value = getattr(limits, field)
        if math.isnan(value) or value < 0:
            raise InvalidArgument(f"limits.{field} must be >= 0 (0 takes the default), got {value}")
        if value > ceiling:
            raise InvalidArgument(f"limits.{field}={value} is above the ceiling {ceiling}")
        return value or default

    s = settings
    return ResourceLimits(
        timeout_seconds=float(pick("timeout_seconds", s.default_timeout_seconds, s.max_timeout_seconds)),
        memory_mb=int(pick("memory_mb", s.default_memory_mb, s.max_memory_mb)),
        cpu_seconds=float(pick("cpu_seconds", s.default_cpu_seconds, s.max_cpu_seconds)),
        max_output_bytes=int(pick("max_output_bytes", s.default_max_output_bytes, s.max_output_bytes)),
    )


def to_verdict(outcome: Outcome) -> common_pb2.Verdict:
    return common_pb2.Verdict(
        status=_STATUS[outcome.status],
        tests_passed=outcome.tests_passed,
        tests_total=outcome.tests_total,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        output_truncated=outcome.output_truncated,
        duration_seconds=outcome.duration_seconds,
        error_message=outcome.error_message,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, backend: SandboxBackend, settings: SandboxSettings) -> None:
        self._backend = backend
        self._settings = settings
        self._admission = Admission(settings.max_concurrency, settings.max_queued)

    async def Execute(
        self, request: sandbox_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ExecuteResponse:
        limits = resolve_limits(request.limits, self._settings)
        async with self._admission.slot():
            outcome = await self._backend.execute(dict(request.files), list(request.command), limits)
        return sandbox_pb2.ExecuteResponse(verdict=to_verdict(outcome))

    async def RunTests(
        self, request: sandbox_pb2.RunTestsRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.RunTestsResponse:
        limits = resolve_limits(request.limits, self._settings)
        async with self._admission.slot():
            outcome = await self._backend.run_tests(request.program, list(request.tests), limits)
        return sandbox_pb2.RunTestsResponse(verdict=to_verdict(outcome))

    async def ScorePatch(
        self, request: sandbox_pb2.ScorePatchRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ScorePatchResponse:
        raise Unimplemented("SWE-style patch scoring is not built yet: it needs the docker backend")
