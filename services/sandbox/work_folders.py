"""Per-call work folders that name their owner, so the next start removes a killed service's.

    WorkFolders(work_root).make()
        --> <work root>/dockyard-sandbox-<token>.owner   written once, before any folder: the service
                                                          process (host/pid/start time, as docker labels say)
        --> <work root>/dockyard-sandbox-<token>-<random>/ (mkdtemp, 0700): one call's folder
    WorkFolders.close()  --> the .owner file removed once none of its folders is left
    reap_dead_work_folders(work_root)  (at start, before serving)
        --> every folder of a token whose .owner names a service of this host that no longer runs,
            removed, then that .owner file

An isolated RunTests run has no host folder at all (unmade(): only its path, where its sandbox
mounts a tmpfs), so a sandbox started ahead of its call (warm_pool.py) leaves nothing on the host.

Guarantees: a call's folder is removed when the call ends whatever happened (the backends' finally);
a service killed before that (SIGKILL, OOM) leaves folders that its successor on the same work root
removes at start. Only a dead owner's are touched: a live service's (its pid running with the same
start time), another host's (a shared work root) and folders without a readable .owner (older
ones, or another program's) are left alone. The token is random, so the path the code may see
names neither the host nor the service's pid.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import tempfile
import threading
from pathlib import Path

import structlog

from services.sandbox.docker_container import owner_is_dead, owner_label
from services.sandbox.staging import remove_tree

log = structlog.get_logger()

PREFIX = "dockyard-sandbox-"
OWNER_SUFFIX = ".owner"
_OWNER_FILE = re.compile(rf"^{re.escape(PREFIX)}([0-9a-f]{{16}}){re.escape(OWNER_SUFFIX)}$")


class WorkFolders:
    """Makes this service's work folders under one root, all named with one token and its .owner file."""

    def __init__(self, work_root: str | None) -> None:
        self._parent = Path(work_root or tempfile.gettempdir())
        self._token = secrets.token_hex(8)
        self._owner_file = self._parent / f"{PREFIX}{self._token}{OWNER_SUFFIX}"
        # Calls make and close folders from several threads at once: the .owner file is written,
        # checked and removed under this lock, so no folder is made while its owner file is going.
        self._lock = threading.Lock()

    def make(self) -> str:
        """A fresh, empty work folder (0700); OSError when the root is unusable. Blocks (file system)."""
        with self._lock:
            if not self._owner_file.exists():  # first: a folder never exists without its owner named
                partial = self._owner_file.with_name(self._owner_file.name + ".partial")
                partial.write_text(owner_label())
                os.replace(partial, self._owner_file)
            return tempfile.mkdtemp(prefix=f"{PREFIX}{self._token}-", dir=self._parent)

    def unmade(self) -> str:
        """A fresh path named like the folders, not made on the host: an isolated RunTests run's work
        folder is a tmpfs at this path inside its own sandbox, with nothing staged from the host."""
        return str(self._parent / f"{PREFIX}{self._token}-{secrets.token_hex(6)}")

    async def make_off_loop(self) -> str:
        """make() in a worker thread; a caller cancelled meanwhile leaves no folder behind."""
        making = asyncio.ensure_future(asyncio.to_thread(self.make))
        try:
            return await asyncio.shield(making)
        except asyncio.CancelledError:
            await asyncio.wait([making])
            if not making.cancelled() and making.exception() is None:
                await asyncio.to_thread(remove_tree, making.result())
            raise

    def close(self) -> None:
        """Forget the .owner file once no folder of this service is left (a left one stays reapable)."""
        with self._lock:
            if not any(self._parent.glob(f"{PREFIX}{self._token}-*")):
                self._owner_file.unlink(missing_ok=True)


def reap_dead_work_folders(work_root: str | None) -> int:
    """Remove the work folders a dead service of this host left under the work root; returns how many. Blocks."""
    parent = Path(work_root or tempfile.gettempdir())
    count = 0
    for owner_file in parent.glob(f"{PREFIX}*{OWNER_SUFFIX}"):
        match = _OWNER_FILE.match(owner_file.name)
        if match is None:
            continue
        try:
            owner = owner_file.read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if owner == owner_label() or not owner_is_dead(owner):
            continue
        for folder in parent.glob(f"{PREFIX}{match.group(1)}-*"):
            remove_tree(str(folder))
            count += not os.path.lexists(folder)
        if not any(parent.glob(f"{PREFIX}{match.group(1)}-*")):
            owner_file.unlink(missing_ok=True)
    if count:
        log.info("removed the work folders of a dead sandbox service", count=count, root=str(parent))
    return count
