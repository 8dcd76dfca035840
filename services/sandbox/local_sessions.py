"""Local-backend sessions: a work folder kept on the host; each command a fresh bubblewrap run over it.

    <work root>/dockyard-session-<random>/
        .dockyard-session   marker: the owning service (host/pid/start time, as docker labels say)
        tree/               the work folder; the commands see it at this same path (cwd, HOME)
    exec   --> keep-<random>/ (empty) --> LocalBackend.run_kept: tree staged into the run's tmpfs
               (max_disk_mb), the command run with every limit of Execute, every process of the run
               killed, the tmpfs copied out into keep-<random>/ --> keep-<random>/ becomes tree/
    read / write_file  --> session_files on tree/ (links never followed)
    close  --> the running command's group killed, the folder removed
    start  --> reap_dead_sessions: folders whose marker names a dead service of this host removed

Guarantees: what a command leaves in its work folder is what the next one finds; no
process outlives its command (the run's pid namespace ends with it); the folder never holds
more than max_disk_mb (it comes out of a tmpfs of that size; WriteFile is refused beyond
it); a command killed by its wall-clock limit, or whose folder could not be copied out (its
files' sizes add up to more than max_disk_mb, sparse files counted whole; a non-root service
cannot read a file the code made unreadable), leaves the folder as the
previous command left it, and says so in the verdict's error_message; a fifo is kept as a
fifo (as it stays one on docker: ReadFile says it is not a regular file), sockets and devices
are never kept.
A session needs isolation: an unisolated backend refuses to open one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog

from dockyard.rpc.errors import FailedPrecondition
from services.sandbox import session_files
from services.sandbox.backend import Outcome, ResourceLimits, SessionHandle
from services.sandbox.docker_container import folder_bytes, owner_is_dead, owner_label
from services.sandbox.staging import checked_files, remove_tree, stage_files

log = structlog.get_logger()

PREFIX = "dockyard-session-"
MARKER = ".dockyard-session"
TREE = "tree"


class KeptRunner(Protocol):
    """What a session needs of the local backend (LocalBackend provides it). Declared here so that
    local.py imports this module and not the other way round."""

    @property
    def isolated(self) -> bool: ...

    def python_argv(self, command: Sequence[str]) -> list[str]: ...

    async def run_kept(
        self, argv: list[str], work: str, keep: str, limits: ResourceLimits, stdin: bytes | None, groups: set[int]
    ) -> tuple[Outcome, bool, str]: ...

    def kill_group(self, pgid: int) -> None: ...


class LocalSession(SessionHandle):
    def __init__(self, backend: KeptRunner, root: Path, max_disk_bytes: int) -> None:
        self._backend = backend
        self._root = root
        self._tree = root / TREE
        self.work_dir = str(self._tree)
        self._max_disk_bytes = max_disk_bytes
        self._groups: set[int] = set()

    async def exec(self, argv: Sequence[str], stdin: bytes | None, limits: ResourceLimits) -> Outcome:
        keep = await asyncio.to_thread(tempfile.mkdtemp, prefix="keep-", dir=self._root)
        try:
            outcome, kept, why = await self._backend.run_kept(
                self._backend.python_argv(argv), self.work_dir, keep, limits, stdin, self._groups
            )
            if kept:
                await asyncio.to_thread(self._swap_in, keep)
                return outcome
        finally:
            await asyncio.to_thread(remove_tree, keep)
        note = "the command was killed" if why == "" else f"its work folder could not be copied out ({why})"
        message = f"{outcome.error_message}; " if outcome.error_message else ""
        message += f"the session's files are as before this command: {note}"
        return dataclasses.replace(outcome, error_message=message)

    def _swap_in(self, keep: str) -> None:
        old = self._root / f"old-{os.path.basename(keep)}"
        os.rename(self._tree, old)
        os.rename(keep, self._tree)
        remove_tree(str(old))

    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        return await asyncio.to_thread(session_files.read_file, self.work_dir, path, max_bytes)

    async def write_file(self, path: str, data: bytes) -> None:
        def write() -> None:
            used = folder_bytes(self.work_dir)
            if used + len(data) > self._max_disk_bytes:
                message = f"{path!r}: {used} + {len(data)} bytes exceed the disk limit (DOCKYARD_SANDBOX_MAX_DISK_MB)"
                raise session_files.FileProblem("full", message)
            session_files.write_file(self.work_dir, path, data)

        await asyncio.to_thread(write)

    async def export_tree(self, target: str) -> str:
        return self.work_dir  # already a host folder

    def kill(self) -> None:
        for group in list(self._groups):
            self._backend.kill_group(group)

    async def close(self) -> None:
        await asyncio.to_thread(remove_tree, str(self._root))


async def open_local_session(
    backend: KeptRunner,
    files: Mapping[str, str],
    *,
    seed_dir: str | None,
    work_root: str | None,
    max_disk_bytes: int,
) -> LocalSession:
    """A session folder holding a copy of `seed_dir` overlaid with `files`; FailedPrecondition beyond max_disk_bytes."""
    if not backend.isolated:
        raise FailedPrecondition("sessions need an isolated local backend (bubblewrap); this one runs unisolated")
    checked = checked_files(files)

    def make() -> Path:
        root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=work_root))
        try:
            (root / MARKER).write_text(owner_label())
            (root / TREE).mkdir()
            stage_files(str(root / TREE), checked, seed_dir)
            size = folder_bytes(str(root / TREE))
            if size > max_disk_bytes:
                raise FailedPrecondition(
                    f"the session's files ({size} bytes) exceed the disk limit (DOCKYARD_SANDBOX_MAX_DISK_MB)"
                )
        except BaseException:
            remove_tree(str(root))
            raise
        return root

    root = await asyncio.to_thread(make)
    return LocalSession(backend, root, max_disk_bytes)


def reap_dead_sessions(work_root: str | None) -> int:
    """Remove session folders under the work root that a dead service of this host left; returns how many."""
    parent = Path(work_root or tempfile.gettempdir())
    count = 0
    for folder in parent.glob(f"{PREFIX}*"):
        try:
            owner = (folder / MARKER).read_text()
        except OSError:
            continue  # not a session folder, or not ours to judge
        if owner != owner_label() and owner_is_dead(owner):
            remove_tree(str(folder))
            count += not folder.exists()
    return count
