"""gRPC face of the sandbox: validates limits, calls the backend, returns verdicts.

Execute / RunTests --> resolve_limits (0 -> default; < 0, NaN, > ceiling -> INVALID_ARGUMENT)
                   --> Admission (max_concurrency running, max_queued waiting, else RESOURCE_EXHAUSTED)
                   --> SandboxBackend --> Outcome --> common.v1.Verdict
ScorePatch         --> task set instance (NOT_FOUND / FAILED_PRECONDITION) --> Admission --> SweScorer --> Verdict
Reward             --> reward_runner.run_reward (the function through the backend's execute) --> Verdict + reward
ListInstances      --> the instances of the task sets under the task root (held-out parts omitted)
OpenSession, SessionExec, ReadFile, WriteFile, CloseSession, ScoreSession
                   --> session_api.SessionService (its checks, the store, the backend's session)
PrepareSessions / ReleaseSessions --> the backend's warm sessions of a job (docker: docker_warm.py); a SWE
                   task set's instance images made (SweScorer.image, as a first run would)

Requests are bounded before any work: at most MAX_FILES files under paths of at most
MAX_PATH_CHARS characters and MAX_PATH_DEPTH parts, at most MAX_ARGS command arguments
and MAX_TESTS tests, no NUL byte in a path or an argument (the OS cannot take one), an
endpoint_address of host:port in at most MAX_ADDRESS_CHARS characters, a Reward's source, input
size and nesting within reward_runner's limits;
anything else is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import grpc
import structlog

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.sandbox.admission import Admission
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend, Status
from services.sandbox.endpoint_route import split_address
from services.sandbox.images import package_error
from services.sandbox.reward_runner import reward_arguments, run_reward
from services.sandbox.session_api import SessionService
from services.sandbox.settings import SandboxSettings
from services.sandbox.staging import MAX_PATH_CHARS, MAX_PATH_DEPTH
from services.sandbox.swe import SweResult, SweScorer, TaskSetError, TaskSets
from services.sandbox.terminal import TerminalTasks

MAX_FILES = 1000
MAX_ARGS = 1024
MAX_TESTS = 1000
MAX_ADDRESS_CHARS = 256  # a host name is at most 253 characters, then :port

_STATUS = {
    Status.PASSED: common_pb2.VERDICT_STATUS_PASSED,
    Status.FAILED: common_pb2.VERDICT_STATUS_FAILED,
    Status.ERROR: common_pb2.VERDICT_STATUS_ERROR,
    Status.TIMEOUT: common_pb2.VERDICT_STATUS_TIMEOUT,
}

log = structlog.get_logger()


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


def check_endpoint_address(address: str) -> None:
    """A session's endpoint_address: host:port, at most MAX_ADDRESS_CHARS characters."""
    if len(address) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"endpoint_address: {len(address)} characters; at most {MAX_ADDRESS_CHARS}")
    try:
        split_address(address)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_files(files: Mapping[str, str]) -> None:
    if len(files) > MAX_FILES:
        raise InvalidArgument(f"files: {len(files)} files; at most {MAX_FILES}")
    for name in files:
        if "\0" in name:
            raise InvalidArgument(f"files: {name[:80]!r} holds a NUL byte")
        if len(name) > MAX_PATH_CHARS or name.count("/") >= MAX_PATH_DEPTH:
            raise InvalidArgument(
                f"files: {name[:80]!r} is {len(name)} characters in {name.count('/') + 1} parts; "
                f"at most {MAX_PATH_CHARS} characters and {MAX_PATH_DEPTH} parts"
            )


def check_command(command: Sequence[str]) -> None:
    if len(command) > MAX_ARGS:
        raise InvalidArgument(f"command: {len(command)} arguments; at most {MAX_ARGS}")
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise InvalidArgument(f"command[{i}] holds a NUL byte")


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


_TASK_SET_ERRORS = {"not_found": NotFound, "invalid": InvalidArgument, "unusable": FailedPrecondition}
_SWE_STATUS = {
    "passed": common_pb2.VERDICT_STATUS_PASSED,
    "failed": common_pb2.VERDICT_STATUS_FAILED,
    "patch_failed": common_pb2.VERDICT_STATUS_PATCH_FAILED,
    "timeout": common_pb2.VERDICT_STATUS_TIMEOUT,
    "error": common_pb2.VERDICT_STATUS_ERROR,
}


def swe_response(result: SweResult) -> sandbox_pb2.ScorePatchResponse:
    outcome = result.outcome or Outcome(Status.ERROR)
    verdict = common_pb2.Verdict(
        status=_SWE_STATUS[result.status],
        tests_passed=result.tests_passed,
        tests_total=result.tests_total,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        output_truncated=outcome.output_truncated,
        duration_seconds=outcome.duration_seconds,
        error_message=result.error_message,
        integrity_violation=result.integrity_violation,
        protected_paths_touched=result.protected_paths_touched,
    )

    def results(tests: dict[str, bool]) -> list[sandbox_pb2.TestResult]:
        return [sandbox_pb2.TestResult(name=t, passed=ok, status=result.statuses.get(t, "")) for t, ok in tests.items()]

    return sandbox_pb2.ScorePatchResponse(
        verdict=verdict,
        resolved=result.resolved,
        pass_rate=result.pass_rate,
        fail_to_pass=results(result.fail_to_pass),
        pass_to_pass=results(result.pass_to_pass),
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(
        self,
        backend: SandboxBackend,
        settings: SandboxSettings,
        swe: SweScorer | None = None,
        terminal: TerminalTasks | None = None,
    ) -> None:
        self._backend = backend
        self._settings = settings
        self._admission = Admission(settings.max_concurrency, settings.max_queued)
        self._swe = swe or SweScorer(
            backend,
            TaskSets(settings.task_root),
            log_cap_bytes=settings.max_output_bytes,
            checkout_root=settings.work_root,
        )
        self._terminal = terminal or TerminalTasks(settings.task_root, None)
        self._sessions = SessionService(backend, settings, self._swe, self._admission, self._terminal)

    def start(self) -> None:
        """Start reaping idle sessions (needs the running event loop)."""
        self._sessions.store.start_reaper()

    async def close_sessions(self) -> None:
        await self._sessions.store.close_all()

    def close(self) -> None:
        self._swe.close()

    def load(self) -> tuple[int, int, int]:
        """(running + queued, running, queued): what heartbeats report to the coordinator."""
        running, queued = self._admission.running, self._admission.waiting
        return running + queued, running, queued

    async def Execute(
        self, request: sandbox_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ExecuteResponse:
        check_files(request.files)
        check_command(request.command)
        limits = resolve_limits(request.limits, self._settings)
        async with self._admission.slot():
            outcome = await self._backend.execute(dict(request.files), list(request.command), limits)
        return sandbox_pb2.ExecuteResponse(verdict=to_verdict(outcome))

    async def RunTests(
        self, request: sandbox_pb2.RunTestsRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.RunTestsResponse:
        if len(request.tests) > MAX_TESTS:
            raise InvalidArgument(f"tests: {len(request.tests)} tests; at most {MAX_TESTS}")
        limits = resolve_limits(request.limits, self._settings)
        async with self._admission.slot():
            outcome = await self._backend.run_tests(request.program, list(request.tests), limits)
        return sandbox_pb2.RunTestsResponse(verdict=to_verdict(outcome))

    async def Reward(
        self, request: sandbox_pb2.RewardRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.RewardResponse:
        arguments = reward_arguments(request.source, request.function, request.input_json)
        limits = resolve_limits(request.limits, self._settings)
        origin = request.origin or request.function
        async with self._admission.slot():
            reward, outcome = await run_reward(
                self._backend, request.source, request.function, origin, arguments, limits
            )
        return sandbox_pb2.RewardResponse(verdict=to_verdict(outcome), reward=reward)

    async def ScorePatch(
        self, request: sandbox_pb2.ScorePatchRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ScorePatchResponse:
        if not request.task_set or not request.instance_id:
            raise InvalidArgument("task_set and instance_id are required")
        limits = self._score_limits(request.limits)
        instance = self._instance(request.task_set, request.instance_id)
        async with self._admission.slot():
            result = await self._swe.score(request.task_set, instance, request.patch, limits)
        return swe_response(result)

    async def ListInstances(
        self, request: sandbox_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ListInstancesResponse:
        task_sets = self._swe.task_sets
        names = [request.task_set] if request.task_set else task_sets.names()
        reply = sandbox_pb2.ListInstancesResponse()
        for name in names:
            try:
                instances = task_sets.instances(name)
            except TaskSetError as exc:
                raise _TASK_SET_ERRORS[exc.kind](str(exc)) from None
            for i in instances.values():
                reply.instances.add(
                    task_set=name,
                    instance_id=i.instance_id,
                    repo=i.repo,
                    base_commit=i.base_commit,
                    num_fail_to_pass=len(i.fail_to_pass),
                    num_pass_to_pass=len(i.pass_to_pass),
                    test_command=i.test_cmd,
                    log_parser=i.log_parser,
                    requirements=i.requirements,
                )
        return reply

    async def OpenSession(
        self, request: sandbox_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.OpenSessionResponse:
        check_files(request.files)
        if request.endpoint_address:
            check_endpoint_address(request.endpoint_address)
        limits = resolve_limits(request.limits, self._settings)
        try:
            session = await self._sessions.open(
                dict(request.files),
                request.task_set,
                request.instance_id,
                limits,
                request.idle_timeout_seconds,
                endpoint_address=request.endpoint_address,
                packages=list(request.packages),
            )
        except TaskSetError as exc:
            raise _TASK_SET_ERRORS[exc.kind](str(exc)) from None
        return sandbox_pb2.OpenSessionResponse(
            session_id=session.id,
            work_dir=session.handle.work_dir,
            idle_timeout_seconds=session.idle_timeout,
            endpoint_url=session.handle.endpoint_url,
        )

    async def PrepareSessions(
        self, request: sandbox_pb2.PrepareSessionsRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.PrepareSessionsResponse:
        if not request.job_id:
            raise InvalidArgument("job_id is required")
        if request.size < 0:
            raise InvalidArgument(f"size must be 0 or more, got {request.size}")
        if problem := package_error(request.packages, self._settings.project_root):
            raise InvalidArgument(problem)
        limits = resolve_limits(request.limits, self._settings)
        instances = {}
        terminal = bool(request.task_set) and self._terminal.is_terminal_set(request.task_set)
        if request.task_set and not terminal:
            try:
                instances = self._swe.task_sets.instances(request.task_set)
            except TaskSetError as exc:
                raise _TASK_SET_ERRORS[exc.kind](str(exc)) from None
        job = {"packages": list(request.packages), "routed": request.routed, "images": list(request.images)}
        try:
            # A share above what this worker may hold is warmed up to its own bound: warming only saves time.
            size = min(request.size, self._settings.max_sessions)
            warm = await self._backend.prepare_sessions(request.job_id, size, limits, **job)
        except (FailedPrecondition, InvalidArgument):
            raise
        except Exception as exc:  # a pull, a build or a start that failed: nothing the caller can fix by retrying
            raise FailedPrecondition(f"cannot prepare the job's sessions: {type(exc).__name__}: {exc}") from None
        if terminal:
            ready = await self._terminal.prepare_images(request.task_set, request.instance_ids)
        else:
            wanted = [instances[i] for i in dict.fromkeys(request.instance_ids) if i in instances]
            ready = await self._swe.prepare_images(request.task_set, wanted)
        return sandbox_pb2.PrepareSessionsResponse(warm=warm, instance_images=ready)

    async def ReleaseSessions(
        self, request: sandbox_pb2.ReleaseSessionsRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ReleaseSessionsResponse:
        if not request.job_id:
            raise InvalidArgument("job_id is required")
        await self._backend.release_sessions(request.job_id)
        return sandbox_pb2.ReleaseSessionsResponse()

    async def SessionExec(
        self, request: sandbox_pb2.SessionExecRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.SessionExecResponse:
        check_command(request.command)
        outcome = await self._sessions.exec(
            request.session_id, list(request.command), request.shell, request.stdin, request.timeout_seconds
        )
        return sandbox_pb2.SessionExecResponse(verdict=to_verdict(outcome), timed_out=outcome.status is Status.TIMEOUT)

    async def ReadFile(
        self, request: sandbox_pb2.ReadFileRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ReadFileResponse:
        content, size = await self._sessions.read_file(request.session_id, request.path, request.max_bytes)
        return sandbox_pb2.ReadFileResponse(content=content, size=size, truncated=len(content) < size)

    async def WriteFile(
        self, request: sandbox_pb2.WriteFileRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.WriteFileResponse:
        await self._sessions.write_file(request.session_id, request.path, request.content)
        return sandbox_pb2.WriteFileResponse()

    async def CloseSession(
        self, request: sandbox_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.CloseSessionResponse:
        await self._sessions.close(request.session_id)
        return sandbox_pb2.CloseSessionResponse()

    async def ScoreSession(
        self, request: sandbox_pb2.ScoreSessionRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ScoreSessionResponse:
        limits = self._score_limits(request.limits)
        try:
            result, patch = await self._sessions.score(request.session_id, limits)
        except TaskSetError as exc:
            raise _TASK_SET_ERRORS[exc.kind](str(exc)) from None
        return sandbox_pb2.ScoreSessionResponse(score=swe_response(result), patch=patch)

    def _score_limits(self, limits: sandbox_pb2.Limits) -> ResourceLimits:
        resolved = resolve_limits(limits, self._settings)
        if limits.max_output_bytes == 0:  # the log is graded whole anyway: 0 returns all of it
            resolved = dataclasses.replace(resolved, max_output_bytes=self._settings.max_output_bytes)
        return resolved

    def _instance(self, task_set: str, instance_id: str):
        try:
            return self._swe.task_sets.instance(task_set, instance_id)
        except TaskSetError as exc:
            raise _TASK_SET_ERRORS[exc.kind](str(exc)) from None
