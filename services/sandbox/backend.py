"""What every sandbox backend provides, independent of gRPC.

    files + argv   --execute-->    Outcome (PASSED iff exit code 0)
    program+tests  --run_tests-->  Outcome (PASSED iff every test passed)
    files          --open_session-->  SessionHandle (a work folder kept across commands)

Limits reach a backend already resolved (defaults filled in, ceilings
checked); a backend raises InvalidArgument for input it refuses (a path
escaping the work folder) and otherwise always returns an Outcome: an
infrastructure failure is an ERROR outcome, never an exception.

SessionHandle is declared here, beside the backend that makes it, so that the
session store (sessions.py) and the backends' sessions depend on this module
and this module on none of them.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dockyard.rpc.errors import FailedPrecondition


class Status(enum.Enum):
    """Mirrors dockyard.common.v1.VerdictStatus."""

    PASSED = "passed"  # exit code 0, or every test passed
    FAILED = "failed"  # the code ran (or crashed by its own doing) and did not pass
    ERROR = "error"  # infrastructure failure: not the policy's fault, masked from rewards
    TIMEOUT = "timeout"  # the wall-clock limit killed it


# The verdict's error_message when a run left its work folder full (a FAILED verdict).
DISK_FULL_MESSAGE = "disk limit exceeded: the work folder is full (DOCKYARD_SANDBOX_MAX_DISK_MB)"


@dataclass(frozen=True)
class ResourceLimits:
    timeout_seconds: float  # wall clock, from spawn to kill
    memory_mb: int  # address space (RLIMIT_AS)
    cpu_seconds: float  # CPU time (RLIMIT_CPU, rounded up to whole seconds)
    max_output_bytes: int  # kept per stream (stdout, stderr); the rest is drained and dropped


@dataclass(frozen=True)
class Outcome:
    """A verdict, field for field like dockyard.common.v1.Verdict."""

    status: Status
    tests_passed: int = 0
    tests_total: int = 0
    exit_code: int = 0  # negative: killed by that signal
    stdout: str = ""
    stderr: str = ""
    output_truncated: bool = False
    duration_seconds: float = 0.0
    error_message: str = ""


def run_outcome(
    status: Status,
    *,
    passed: int,
    total: int,
    exit_code: int,
    stdout: bytes,
    stderr: bytes,
    truncated: bool,
    duration: float,
    error_message: str,
) -> Outcome:
    """The Outcome of a finished run, its output decoded (invalid UTF-8 replaced)."""
    return Outcome(
        status=status,
        tests_passed=passed,
        tests_total=total,
        exit_code=exit_code,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        output_truncated=truncated,
        duration_seconds=duration,
        error_message=error_message,
    )


class SessionHandle(abc.ABC):
    """One backend's live session: a work folder that outlives each command."""

    work_dir: str  # the work folder as commands see it (cwd, HOME)
    endpoint_url: str = ""  # the policy endpoint's URL as commands see it; "" without a route
    warm: bool = False  # taken from sandboxes started ahead of the session (docker_warm.py), not started for it

    @abc.abstractmethod
    async def exec(self, argv: Sequence[str], stdin: bytes | None, limits: ResourceLimits) -> Outcome:
        """Run `argv` in the work folder; PASSED iff exit code 0, TIMEOUT past limits.timeout_seconds."""

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        """(first max_bytes bytes, whole size); session_files.FileProblem when it cannot be read."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace `path`; session_files.FileProblem when it cannot be written."""

    @abc.abstractmethod
    async def export_tree(self, target: str) -> str:
        """A host folder holding the work folder's files (at `target`, or the folder itself on the host)."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the running command now, if any (it ends as an error or a timeout); never raises."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Remove the work folder or container; never raises."""


class SandboxBackend(abc.ABC):
    """Runs untrusted code under limits; safe to call concurrently."""

    @abc.abstractmethod
    async def execute(
        self,
        files: Mapping[str, str],
        command: Sequence[str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
    ) -> Outcome:
        """Run `command` in a fresh work folder holding a copy of `seed_dir` (a trusted host
        folder, e.g. a repository checkout) overlaid with `files` (relative paths).

        `image` names the container image to run in (backends without images ignore it;
        None is the backend's default image).
        """

    @abc.abstractmethod
    async def run_tests(self, program: str, tests: Sequence[str], limits: ResourceLimits) -> Outcome:
        """Run the Python `program`, then each test statement on its own; count the passes."""

    async def open_session(
        self,
        files: Mapping[str, str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
        endpoint_address: str = "",
    ) -> SessionHandle:
        """A work folder (or container) kept across commands, holding `seed_dir` overlaid with `files`;
        `limits.memory_mb` bounds the whole session where the backend can (see sessions.py); with
        `endpoint_address`, the session's only network route is to that host:port."""
        raise FailedPrecondition(f"the {type(self).__name__} backend has no sessions")

    async def packages_image(self, requirements: Sequence[str]) -> str:
        """The tag of an image holding the backend's image plus `requirements` (built once)."""
        raise FailedPrecondition(
            f"the {type(self).__name__} backend cannot install packages into a session; "
            "use the docker backend (DOCKYARD_SANDBOX_BACKEND=docker)"
        )

    async def prepare_sessions(
        self, job_id: str, size: int, limits: ResourceLimits, *, packages: Sequence[str] = (), routed: bool = False,
        images: Sequence[str] = (),
    ) -> int:  # fmt: skip
        """A job's start: `images` pulled when missing, and `size` of its sessions (these limits, packages and
        route kind) started ahead where the backend can; returns how many it keeps started (0: none)."""
        return 0

    async def release_sessions(self, job_id: str) -> None:
        """A job's end: the sessions started ahead for it removed."""

    def reap_sessions(self) -> int:
        """Remove the sessions a dead predecessor of this service left; returns how many. Blocks."""
        return 0

    async def close(self) -> None:
        """Stop whatever is still running; called once at service shutdown."""
