"""One local run's pipes and what they said: the bookkeeping between LocalBackend._start and _finish.

    _start --> uncancelled(spawn) --> Started: the process, our ends of its pipes, one Capture per pipe it writes
               (stdout, stderr, the launcher's status, the harness's report), its stdin transport
    _finish --> Started.close_fds() (always), then Started.collect() --> Run: output, exit code,
               the launcher's status lines (harness.py) turned into error / disk-full / kept

Guarantees: a Capture keeps at most its cap of a stream and drains the rest; close_fds closes every
one of our ends once, whatever was connected; collect() makes an error of a sandbox that never said
"ready" (unless the wall clock killed it first), and the command's own exit code replaces bwrap's.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable
from dataclasses import dataclass, field

from services.sandbox.harness import parse_kept, parse_status
from services.sandbox.staging import REPORT_CAP_BYTES, Capped


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


class Capture(Capped, asyncio.Protocol):
    """Keeps the first `cap` bytes of a pipe and drains the rest."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.add(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


@dataclass
class Run:
    error: str = ""
    timed_out: bool = False
    exit_code: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    duration: float = 0.0
    report: bytes = b""
    disk_full: bool = False
    kept: bool = False  # sessions: the work folder was copied out to the keep folder
    keep_error: str = ""


async def uncancelled(spawn: Awaitable[asyncio.subprocess.Process]) -> asyncio.subprocess.Process:
    """The spawned process; a cancel meanwhile lets the spawn finish, kills its group, then propagates.
    (asyncio's own clean-up of a spawn cut short can wait forever for a child it killed.)"""
    task = asyncio.ensure_future(spawn)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            proc = await task
        except OSError:
            raise asyncio.CancelledError from None
        kill_group(proc.pid)
        await proc.wait()
        raise


def captures(max_output_bytes: int) -> dict[str, Capture]:
    """One Capture per pipe a run writes: its output (capped as the call says), status and report."""
    return {
        "stdout": Capture(max_output_bytes),
        "stderr": Capture(max_output_bytes),
        "status": Capture(4096),
        "report": Capture(REPORT_CAP_BYTES),
    }


@dataclass
class Started:
    """A spawned sandbox whose pipes are connected; LocalBackend._finish hands it its stdin and waits."""

    work: str
    parent_ends: list[int]  # our ends of its pipes not yet owned by a transport
    captures: dict[str, Capture]
    read: list[str]  # the captures connected to a pipe
    proc: asyncio.subprocess.Process | None = None
    stdin: asyncio.WriteTransport | None = None
    transports: list[asyncio.BaseTransport] = field(default_factory=list)
    run: Run = field(default_factory=Run)

    def alive(self) -> bool:
        """Can still take its call (a warm sandbox): spawned, and not exited while it waited."""
        return self.proc is not None and self.proc.returncode is None

    async def connect(self, pipes: dict[str, tuple[int, int]]) -> None:
        """Our ends of `pipes` (name: (read, write)) owned by transports: each pipe but stdin read into its
        capture, stdin written through `self.stdin`. The other ends must be closed already or soon."""
        loop = asyncio.get_running_loop()
        for name, (read_fd, write_fd) in pipes.items():
            if name == "stdin":
                pipe = os.fdopen(write_fd, "wb", buffering=0)  # owns the fd from here on
                self.parent_ends.remove(write_fd)
                self.stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
                self.transports.append(self.stdin)
            else:
                pipe = os.fdopen(read_fd, "rb", buffering=0)
                self.parent_ends.remove(read_fd)
                transport, _ = await loop.connect_read_pipe(lambda capture=self.captures[name]: capture, pipe)
                self.transports.append(transport)

    def close_fds(self) -> None:
        for transport in self.transports:
            transport.close()
        for fd in self.parent_ends:
            os.close(fd)
        self.transports, self.parent_ends = [], []

    def collect(self) -> None:
        """Fill `run` from what the pipes said, once the process is gone and its pipes drained."""
        run, captures = self.run, self.captures
        run.stdout, run.stderr = bytes(captures["stdout"].data), bytes(captures["stderr"].data)
        ready, error, run.disk_full, exit_code = parse_status(bytes(captures["status"].data))
        if error:
            run.error = error
        elif not ready and not run.timed_out:
            tail = run.stderr[-500:].decode("utf-8", errors="replace")
            run.error = f"the sandbox could not be set up (exit code {run.exit_code}): {tail}"
        run.kept, run.keep_error = parse_kept(bytes(captures["status"].data))
        if exit_code is not None:  # the command's own status (bwrap reports a signal as 128 + N)
            run.exit_code = exit_code
        run.truncated = captures["stdout"].truncated or captures["stderr"].truncated
        run.report = bytes(captures["report"].data)
