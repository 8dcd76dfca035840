"""What the session RPCs do, apart from protobuf: checks naming the field at fault, then the store and backend.

    open(files, task_set + instance_id?, limits, idle, endpoint_address?, packages?)
                                      --> SWE: SweScorer.prepare -> checkout (+ image)
                                      --> terminal task (terminal.py, either format): its image + WORKDIR seed
                                      --> file-producing task (gdpval.py): its reference/ as the seed
                                      --> packages: backend.packages_image (the instance's requirements too)
                                                          --> SessionStore.open(backend.open_session)
    exec(id, argv, stdin, timeout)    --> store.use(id) --> Admission slot --> handle.exec
    read_file / write_file(id, path)  --> store.use(id) --> handle (session_files: links never followed)
    close(id)                         --> store.close(id)
    score(id, limits)                 --> store.use(id) --> handle.export_tree --> checkouts.tree_patch
                                        (git diff against the base commit) --> SweScorer.score, the
                                        very call ScorePatch makes with that patch; a terminal task's
                                        session: terminal.score (its tests copied in, run-tests.sh run),
                                        a Harbor task's harbor.score (tests/test.sh, its reward file);
                                        a file-producing task's: gdpval.score (deliverables, then checker.py)

Checks (InvalidArgument naming the field): session_id of 1..64 url-safe characters; paths
relative, without '..' or NUL, at most MAX_PATH_CHARS characters in MAX_PATH_DEPTH parts;
exactly one of command and shell; stdin and file content at most max_file_mb; timeouts,
idle timeouts and read sizes not negative, not NaN, not above their ceilings (0: the default).
A file's state (missing: NotFound; a link or not a regular file on the way: InvalidArgument;
the disk limit reached: ResourceExhausted) is checked where it lives, by the handle.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from dockyard.tasks.harbor import HarborTask
from services.sandbox.admission import Admission
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend
from services.sandbox.checkouts import tree_patch
from services.sandbox.endpoint_route import split_address
from services.sandbox.gdpval import FileTasks
from services.sandbox.gdpval import score as score_file_task
from services.sandbox.harbor import score as score_harbor
from services.sandbox.images import package_error
from services.sandbox.session_files import FileProblem
from services.sandbox.sessions import Session, SessionStore
from services.sandbox.settings import SandboxSettings
from services.sandbox.staging import MAX_PATH_CHARS, MAX_PATH_DEPTH
from services.sandbox.swe import SweResult, SweScorer
from services.sandbox.terminal import TerminalTasks
from services.sandbox.terminal import score as score_terminal

_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_SHELL_CHARS = 128 * 1024  # the kernel's limit on one argument (MAX_ARG_STRLEN)


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id is required")
    if not _SESSION_ID.match(session_id):
        raise InvalidArgument(
            f"session_id {session_id[:40]!r} ({len(session_id)} characters) is not a session id: "
            "1 to 64 characters of A-Z a-z 0-9 _ -"
        )


def check_path(path: str, field: str = "path") -> str:
    if not path:
        raise InvalidArgument(f"{field} is required")
    if "\0" in path:
        raise InvalidArgument(f"{field}: {path[:80]!r} holds a NUL byte")
    if len(path) > MAX_PATH_CHARS or path.count("/") >= MAX_PATH_DEPTH:
        raise InvalidArgument(
            f"{field}: {path[:80]!r} is {len(path)} characters in {path.count('/') + 1} parts; "
            f"at most {MAX_PATH_CHARS} characters and {MAX_PATH_DEPTH} parts"
        )
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts or pure.parts == (".",):
        raise InvalidArgument(f"{field}: {path[:80]!r} must be a file path relative to the work folder, without '..'")
    return str(pure)


def bounded(value: float, field: str, ceiling: float, default: float) -> float:
    """`value`, or `default` for 0; InvalidArgument for negative, NaN or above `ceiling`."""
    if math.isnan(value) or value < 0:
        raise InvalidArgument(f"{field} must be >= 0 (0 takes the default), got {value}")
    if value > ceiling:
        raise InvalidArgument(f"{field}={value} is above the ceiling {ceiling}")
    return value or default


def _file_error(problem: FileProblem, field: str = "path") -> Exception:
    message = f"{field}: {problem}"
    if problem.kind == "not_found":
        return NotFound(message)
    if problem.kind == "full":
        return ResourceExhausted(message)
    return InvalidArgument(message)


class SessionService:
    def __init__(
        self,
        backend: SandboxBackend,
        settings: SandboxSettings,
        swe: SweScorer,
        admission: Admission,
        terminal: TerminalTasks | None = None,
    ) -> None:
        self._backend = backend
        self._settings = settings
        self._swe = swe
        self._terminal = terminal or TerminalTasks(settings.task_root, None)
        self._file_tasks = FileTasks(settings.task_root)
        self._admission = admission
        self.store = SessionStore(settings.max_sessions)
        self._max_file_bytes = settings.max_file_mb * 1024 * 1024

    async def open(
        self,
        files: Mapping[str, str],
        task_set: str,
        instance_id: str,
        limits: ResourceLimits,
        idle_timeout: float,
        *,
        endpoint_address: str = "",
        packages: Sequence[str] = (),
    ) -> Session:
        s = self._settings
        idle = bounded(idle_timeout, "idle_timeout_seconds", s.max_session_idle_seconds, s.session_idle_seconds)
        if bool(task_set) != bool(instance_id):
            missing = "instance_id" if task_set else "task_set"
            raise InvalidArgument(f"{missing} is required with {'task_set' if task_set else 'instance_id'}")
        seed, image, swe, terminal, file_task = None, None, None, None, None
        if task_set and self._file_tasks.is_task_set(task_set):
            file_task = self._file_tasks.task(task_set, instance_id)  # TaskSetError: the caller maps it
            seed = self._file_tasks.seed_dir(file_task)
        elif task_set and self._terminal.is_terminal_set(task_set):
            task = self._terminal.task(task_set, instance_id)  # TaskSetError: the caller maps it
            try:
                prepared = await self._terminal.prepare(task)
            except FailedPrecondition:
                raise
            except Exception as exc:
                raise FailedPrecondition(f"cannot prepare task {instance_id!r} of {task_set!r}: {exc}") from None
            seed, image, terminal = prepared.seed_dir, prepared.image, (task, prepared.workdir)
        elif task_set:
            instance = self._swe.task_sets.instance(task_set, instance_id)  # TaskSetError: the caller maps it
            try:
                checkout, image = await self._swe.prepare(task_set, instance)
            except Exception as exc:
                raise FailedPrecondition(f"cannot prepare {instance_id!r} of {task_set!r}: {exc}") from None
            seed, swe = str(checkout), (task_set, instance_id)
        if endpoint_address:
            try:
                split_address(endpoint_address)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        if packages:
            if problem := package_error(packages, self._settings.project_root):
                raise InvalidArgument(problem)
            required = [*(instance.requirements if swe else ()), *packages]
            try:
                image = await self._backend.packages_image(required)
            except FailedPrecondition:  # the backend's own words (local: use the docker backend)
                raise
            except Exception as exc:
                raise FailedPrecondition(f"cannot build the session's image with {list(packages)!r}: {exc}") from None

        async def make():
            return await self._backend.open_session(
                files, limits, seed_dir=seed, image=image, endpoint_address=endpoint_address
            )

        return await self.store.open(
            make, limits=limits, idle_timeout=idle, swe=swe, terminal=terminal, file_task=file_task
        )

    async def exec(self, session_id: str, command: Sequence[str], shell: str, stdin: bytes, timeout: float) -> Outcome:
        check_session_id(session_id)
        if bool(command) == bool(shell):
            raise InvalidArgument("command and shell: give exactly one (argv, or a line for `sh -c`)")
        if command and not command[0]:
            raise InvalidArgument("command: must name the program to run")
        if "\0" in shell or len(shell) > MAX_SHELL_CHARS:
            raise InvalidArgument(f"shell: {len(shell)} characters; at most {MAX_SHELL_CHARS}, no NUL byte")
        if len(stdin) > self._max_file_bytes:
            raise InvalidArgument(
                f"stdin: {len(stdin)} bytes; at most {self._max_file_bytes} (DOCKYARD_SANDBOX_MAX_FILE_MB)"
            )
        argv = list(command) if command else ["sh", "-c", shell]
        async with self.store.use(session_id) as session:
            ceiling = self._settings.max_timeout_seconds
            seconds = bounded(timeout, "timeout_seconds", ceiling, session.limits.timeout_seconds)
            limits = dataclasses.replace(session.limits, timeout_seconds=seconds)
            async with self._admission.slot():
                return await session.handle.exec(argv, stdin or None, limits)

    async def read_file(self, session_id: str, path: str, max_bytes: int) -> tuple[bytes, int]:
        check_session_id(session_id)
        path = check_path(path)
        ceiling = self._settings.max_output_bytes
        cap = int(bounded(max_bytes, "max_bytes", ceiling, ceiling))
        async with self.store.use(session_id) as session:
            try:
                return await session.handle.read_file(path, cap)
            except FileProblem as problem:
                raise _file_error(problem) from None

    async def write_file(self, session_id: str, path: str, content: bytes) -> None:
        check_session_id(session_id)
        path = check_path(path)
        if len(content) > self._max_file_bytes:
            raise InvalidArgument(
                f"content: {len(content)} bytes; at most {self._max_file_bytes} (DOCKYARD_SANDBOX_MAX_FILE_MB)"
            )
        async with self.store.use(session_id) as session:
            try:
                await session.handle.write_file(path, content)
            except FileProblem as problem:
                raise _file_error(problem) from None

    async def close(self, session_id: str) -> None:
        check_session_id(session_id)
        await self.store.close(session_id)

    async def score(self, session_id: str, limits: ResourceLimits) -> tuple[SweResult, str]:
        """(the SWE verdict, the patch scored): the work folder's diff against the base, as ScorePatch scores it."""
        check_session_id(session_id)
        async with self.store.use(session_id) as session:
            if session.terminal is not None:
                task, workdir = session.terminal
                async with self._admission.slot():
                    s = self._settings
                    scorer = score_harbor if isinstance(task, HarborTask) else score_terminal
                    result = await scorer(
                        session.handle,
                        task,
                        workdir,
                        limits,
                        max_timeout=s.max_timeout_seconds,
                        log_cap=s.max_output_bytes,
                    )
                return result, ""
            if session.file_task is not None:
                async with self._admission.slot():
                    result = await score_file_task(
                        session.handle, session.file_task, limits, max_timeout=self._settings.max_timeout_seconds
                    )
                return result, ""
            if session.swe is None:
                raise FailedPrecondition(
                    "ScoreSession needs a SWE session, or a terminal or file-producing task's "
                    "(opened with task_set and instance_id)"
                )
            task_set, instance_id = session.swe
            instance = self._swe.task_sets.instance(task_set, instance_id)
            scratch_root = self._settings.work_root
            with tempfile.TemporaryDirectory(prefix="dockyard-session-export-", dir=scratch_root) as scratch:
                tree = await session.handle.export_tree(scratch)
                checkout, _ = await self._swe.prepare(task_set, instance)
                patch = await tree_patch(checkout, tree)
            async with self._admission.slot():
                result = await self._swe.score(task_set, instance, patch, limits)
        return result, patch
