"""A sandbox session seen as a client: open it on one worker, run commands, read and write files, close it.

Guarantees: every call goes to the worker that opened the session (sessions live there); a command's
result is the sandbox's verdict reduced to exit code, output and whether the wall-clock limit killed
it; gRPC errors propagate unchanged (the caller decides what is an infrastructure failure); `close`
never raises, so a trial's cleanup cannot mask the error that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

# RPC deadline margin over the sandbox's own command limit (queueing, transfer).
DEADLINE_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    error: str = ""  # the sandbox could not run it (its container is gone): an infrastructure failure


class SandboxSession:
    def __init__(
        self,
        stub: sandbox_pb2_grpc.SandboxServiceStub,
        session_id: str,
        work_dir: str,
        timeout_seconds: float,
        endpoint_url: str = "",
    ) -> None:
        self.stub, self.session_id, self.work_dir = stub, session_id, work_dir
        self.endpoint_url = endpoint_url  # the policy endpoint as the session's commands reach it ("" if they cannot)
        self._deadline = timeout_seconds + DEADLINE_MARGIN_SECONDS

    @classmethod
    async def open(
        cls,
        stub: sandbox_pb2_grpc.SandboxServiceStub,
        request_id: str,
        *,
        files: dict[str, str],
        limits: sandbox_pb2.Limits,
        task_set: str = "",
        instance_id: str = "",
        idle_timeout_seconds: float = 0.0,
        endpoint_address: str = "",
        packages: tuple[str, ...] = (),
    ) -> SandboxSession:
        reply = await stub.OpenSession(
            sandbox_pb2.OpenSessionRequest(
                request_id=request_id,
                files=files,
                task_set=task_set,
                instance_id=instance_id,
                limits=limits,
                idle_timeout_seconds=idle_timeout_seconds,
                endpoint_address=endpoint_address,
                packages=packages,
            ),
            # A SWE checkout, or an image with `packages` built the first time, takes a while.
            timeout=limits.timeout_seconds + DEADLINE_MARGIN_SECONDS + (900.0 if packages else 300.0),
        )
        return cls(stub, reply.session_id, reply.work_dir, limits.timeout_seconds, reply.endpoint_url)

    async def run(self, argv: list[str] | None = None, shell: str | None = None, timeout: float = 0.0) -> CommandResult:
        """One command (an argv, or a shell line) in the work folder; `timeout` 0: the session's limit."""
        request = sandbox_pb2.SessionExecRequest(
            session_id=self.session_id, command=argv or [], shell=shell or "", timeout_seconds=timeout
        )
        deadline = timeout + DEADLINE_MARGIN_SECONDS if timeout else self._deadline
        reply = await self.stub.SessionExec(request, timeout=deadline)
        v = reply.verdict
        error = v.error_message or "the sandbox failed" if v.status == common_pb2.VERDICT_STATUS_ERROR else ""
        return CommandResult(v.exit_code, v.stdout, v.stderr, reply.timed_out, error)

    async def read_file(self, path: str, max_bytes: int = 0) -> tuple[bytes, bool]:
        """(content, truncated)."""
        reply = await self.stub.ReadFile(
            sandbox_pb2.ReadFileRequest(session_id=self.session_id, path=path, max_bytes=max_bytes),
            timeout=self._deadline,
        )
        return reply.content, reply.truncated

    async def write_file(self, path: str, content: bytes) -> None:
        await self.stub.WriteFile(
            sandbox_pb2.WriteFileRequest(session_id=self.session_id, path=path, content=content),
            timeout=self._deadline,
        )

    async def score(self, limits: sandbox_pb2.Limits) -> sandbox_pb2.ScoreSessionResponse:
        """SWE sessions: the work folder's diff against the base commit, scored like a patch."""
        return await self.stub.ScoreSession(
            sandbox_pb2.ScoreSessionRequest(session_id=self.session_id, limits=limits),
            timeout=limits.timeout_seconds + DEADLINE_MARGIN_SECONDS + 300.0,
        )

    async def close(self) -> None:
        try:
            await self.stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=self.session_id), timeout=30.0)
        except grpc.aio.AioRpcError:
            pass  # reaped, or the worker is gone: the sandbox cleans up idle and orphaned sessions itself
