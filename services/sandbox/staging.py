"""What both backends do with a call's files before a run, and with its report after.

    files --checked_files--> relative, '..'-free paths (InvalidArgument otherwise)
          --stage_files (stage_files_off_loop: a worker thread)--> work folder <-- seed_dir copy, then the files
    run   --Capped--> the first `cap` bytes of a stream, the rest dropped
          --parse_report(nonce)--> (harness started, per-test results or None)
    done  --remove_tree (worker thread)--> the work folder gone, even folders the code made unwritable

Guarantees: no file is written outside the work folder (paths are checked before
anything is written); a name that is both a file and a folder is refused; a
report line without the run's nonce is ignored; a stream is never kept beyond its
cap. The file functions block: callers run them off the event loop.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import structlog

from dockyard.rpc.errors import InvalidArgument

log = structlog.get_logger()

REPORT_CAP_BYTES = 64 * 1024
# Longest path a request may name, in characters and in parts.
MAX_PATH_CHARS = 1024
MAX_PATH_DEPTH = 32
# (path inside the work folder, content): text is written as UTF-8.
Writes = Sequence[tuple[PurePosixPath | str, str | bytes]]


def checked_files(files: Mapping[str, str]) -> list[tuple[PurePosixPath, str]]:
    """Relative, '..'-free paths that stay inside the work folder; InvalidArgument otherwise."""
    checked = []
    for name, content in files.items():
        path = PurePosixPath(name)
        if not name or "\x00" in name or path.is_absolute() or ".." in path.parts or not path.parts:
            raise InvalidArgument(f"files: {name!r} must be a relative path inside the work folder, without '..'")
        checked.append((path, content))
    folders = {parent for path, _ in checked for parent in path.parents}
    for path, _ in checked:
        if path in folders:
            raise InvalidArgument(f"files: {str(path)!r} is both a file and a folder")
    return checked


def stage_files(work: str, writes: Writes, seed_dir: str | None) -> None:
    """Copy `seed_dir` into `work`, then write `writes` (checked paths). Raises OSError."""
    if seed_dir is not None:
        shutil.copytree(seed_dir, work, symlinks=True, dirs_exist_ok=True)
    for name, content in writes:
        target = Path(work, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))


async def stage_files_off_loop(work: str, writes: Writes, seed_dir: str | None) -> None:
    """stage_files in a worker thread, so the loop keeps serving while up to max_files files are written.

    A cancelled caller still waits for the thread: the work folder is removed only once nothing writes to it.
    """
    staging = asyncio.ensure_future(asyncio.to_thread(stage_files, work, writes, seed_dir))
    try:
        await asyncio.shield(staging)
    except asyncio.CancelledError:
        await asyncio.wait([staging])
        raise


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # the code may have made folders unwritable to us
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                try:
                    os.chmod(os.path.join(root, name), 0o700)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        log.warning("work folder left behind", path=path)


class Capped:
    """Keeps the first `cap` bytes it is given and drops the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.truncated = cap, bytearray(), False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk


def parse_report(report: bytes, nonce: bytes, tests_total: int) -> tuple[bool, list[bool] | None]:
    """(harness started, per-test results or None); lines without the nonce are ignored."""
    started, results = False, None
    for line in report.split(b"\n"):
        head, _, body = line.partition(b" ")
        if not secrets.compare_digest(head, nonce):
            continue
        if body == b"ready":
            started = True
        elif body.startswith(b"result ") and results is None:
            bits = body[len(b"result ") :]
            if len(bits) == tests_total and set(bits) <= {ord("0"), ord("1")}:
                results = [bit == ord("1") for bit in bits]
    return started, results
