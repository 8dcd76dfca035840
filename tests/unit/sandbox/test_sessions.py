"""The session store (bounds, ids, NotFound, reaping, close during a command), confined file access,
the local backend's cleanup of a dead service's session folders, and the tree diff ScoreSession scores."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from dockyard.rpc.errors import NotFound, ResourceExhausted
from services.sandbox.backend import Outcome, ResourceLimits, SessionHandle, Status
from services.sandbox.checkouts import Checkouts, tree_patch
from services.sandbox.docker_container import owner_label
from services.sandbox.local_sessions import MARKER, PREFIX, reap_dead_sessions
from services.sandbox.session_files import FileProblem, read_file, write_file
from services.sandbox.sessions import SessionStore
from tests.conftest import require_docker, require_tool
from tests.unit.sandbox.swe_repo import FIXED, git, make_task_set

LIMITS = ResourceLimits(timeout_seconds=5, memory_mb=256, cpu_seconds=5, max_output_bytes=1024)


class FakeHandle(SessionHandle):
    work_dir = "/work"

    def __init__(self) -> None:
        self.closed = False
        self.killed = asyncio.Event()

    async def exec(self, argv, stdin, limits) -> Outcome:
        if argv == ["hang"]:
            await self.killed.wait()  # ends only when killed, as a real command would
            return Outcome(Status.ERROR, error_message="killed")
        return Outcome(Status.PASSED, stdout=" ".join(argv))

    async def read_file(self, path, max_bytes):
        return b"", 0

    async def write_file(self, path, data):
        pass

    async def export_tree(self, target):
        return target

    def kill(self) -> None:
        self.killed.set()

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def open_one(store: SessionStore, idle: float = 60.0):
    handle = FakeHandle()

    async def make():
        return handle

    return await store.open(make, limits=LIMITS, idle_timeout=idle), handle


async def test_sessions_are_bounded_and_ids_unguessable():
    store = SessionStore(2)
    (a, _), (b, _) = await open_one(store), await open_one(store)
    assert a.id != b.id and len(a.id) >= 40  # 32 random bytes, url-safe
    with pytest.raises(ResourceExhausted) as full:
        await open_one(store)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "DOCKYARD_SANDBOX_MAX_SESSIONS" in str(full.value)
    await store.close(a.id)
    await open_one(store)  # room again
    assert len(store) == 2


async def test_the_open_log_line_says_whether_the_session_was_taken_warm():
    store = SessionStore(2)
    warm = FakeHandle()
    warm.warm = True

    async def make_warm():
        return warm

    with capture_logs() as logs:
        await store.open(make_warm, limits=LIMITS, idle_timeout=60)
        await open_one(store)  # a handle started for its session: cold
    opened = [line for line in logs if line["event"] == "session opened"]
    assert [line["warm"] for line in opened] == [True, False], opened


async def test_a_closed_session_is_not_found_and_its_handle_closed():
    store = SessionStore(4)
    session, handle = await open_one(store)
    async with store.use(session.id) as used:
        assert (await used.handle.exec(["echo", "hi"], None, LIMITS)).stdout == "echo hi"
    await store.close(session.id)
    assert handle.closed
    for call in (store.close(session.id), store.use(session.id).__aenter__()):
        with pytest.raises(NotFound):
            await call
    with pytest.raises(NotFound):
        await store.close("never-opened")


async def test_idle_sessions_are_reaped_busy_ones_kept_and_use_restarts_the_clock():
    clock = Clock()
    store = SessionStore(4, clock=clock)
    idle, idle_handle = await open_one(store, idle=10)
    used, _ = await open_one(store, idle=10)
    busy, busy_handle = await open_one(store, idle=10)
    clock.now += 8
    async with store.use(used.id):
        pass  # its idle clock starts again at 1008
    started = asyncio.Event()

    async def hang():
        async with store.use(busy.id) as session:
            started.set()
            return await session.handle.exec(["hang"], None, LIMITS)

    call = asyncio.create_task(hang())
    await started.wait()
    clock.now += 5  # 13 s after open, 5 s after the last use
    assert await store.reap_idle() == 1
    assert idle_handle.closed and not busy_handle.closed
    with pytest.raises(NotFound):
        await store.close(idle.id)
    clock.now += 10
    assert await store.reap_idle() == 1  # `used` now; `busy` is still in its call
    await store.close(busy.id)  # kills the running command, then closes
    assert (await call).status is Status.ERROR and busy_handle.closed


async def test_the_reaper_task_closes_an_idle_session():
    store = SessionStore(2)
    session, handle = await open_one(store, idle=0.05)
    store.start_reaper(interval=0.02)
    try:
        for _ in range(500):
            if handle.closed:
                break
            await asyncio.sleep(0.01)
        assert handle.closed
        with pytest.raises(NotFound):
            await store.close(session.id)
    finally:
        await store.close_all()


async def test_close_all_closes_every_session():
    store = SessionStore(3)
    handles = [(await open_one(store))[1] for _ in range(3)]
    await store.close_all()
    assert all(h.closed for h in handles) and len(store) == 0


def test_files_are_confined_to_the_work_folder(tmp_path: Path):
    root = tmp_path / "tree"
    root.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    write_file(str(root), "a/b/c.txt", b"hello")
    assert read_file(str(root), "a/b/c.txt", 3) == (b"hel", 5)
    (root / "link").symlink_to(secret)
    (root / "dir").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")
    for path in ("link", "dir/secret.txt", "fifo", "a"):
        with pytest.raises(FileProblem) as problem:
            read_file(str(root), path, 100)
        assert problem.value.kind == "refused", path
    with pytest.raises(FileProblem) as problem:
        write_file(str(root), "dir/new.txt", b"x")  # through a linked folder: refused
    assert problem.value.kind == "refused" and not (tmp_path / "new.txt").exists()
    write_file(str(root), "link", b"replaced")  # the link itself is replaced, its target untouched
    assert secret.read_text() == "host secret" and not (root / "link").is_symlink()
    with pytest.raises(FileProblem) as problem:
        read_file(str(root), "missing.txt", 10)
    assert problem.value.kind == "not_found"
    with pytest.raises(FileProblem):
        read_file(str(root), "../secret.txt", 10)


def test_restart_removes_only_a_dead_services_session_folders(tmp_path: Path):
    dead = tmp_path / f"{PREFIX}dead"
    live = tmp_path / f"{PREFIX}live"
    other_host = tmp_path / f"{PREFIX}other"
    unmarked = tmp_path / f"{PREFIX}unmarked"
    for folder in (dead, live, other_host, unmarked):
        (folder / "tree").mkdir(parents=True)
    (dead / MARKER).write_text(f"{socket.gethostname()}/{2**22 + 7}/1")  # no such pid
    (live / MARKER).write_text(owner_label())
    (other_host / MARKER).write_text(f"not-{socket.gethostname()}/1/1")
    assert reap_dead_sessions(str(tmp_path)) == 1
    assert not dead.exists() and live.exists() and other_host.exists() and unmarked.exists()


async def test_tree_patch_is_the_diff_against_the_base_and_leaves_the_checkout_as_it_was(tmp_path: Path):
    require_tool("/usr/bin/git", "git")
    row = make_task_set(tmp_path)
    checkouts = Checkouts(str(tmp_path))
    try:
        checkout = await checkouts.get(tmp_path / "set" / "repos" / "o__r.git", row["base_commit"])
        objects_before = git(checkout, "count-objects", "-v")
        tree = tmp_path / "session-tree"
        shutil.copytree(checkout, tree, symlinks=True)
        (tree / "pkg" / "core.py").write_text(FIXED)
        (tree / "NOTES.md").write_text("new file\n")
        # What running the code leaves behind (bytecode, pytest's cache) is not the agent's change.
        (tree / "pkg" / "__pycache__").mkdir()
        (tree / "pkg" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\x00\x01binary")
        (tree / "stray.pyc").write_bytes(b"\x00\x02binary")
        (tree / ".pytest_cache").mkdir()
        (tree / ".pytest_cache" / "README.md").write_text("cache\n")
        git(tree, "commit", "--quiet", "--all", "-m", "an agent's commit does not hide its change")
        patch = await tree_patch(checkout, str(tree))
        assert "-    return a - b\n+    return a + b\n" in patch
        assert "+++ b/NOTES.md" in patch and "new file mode" in patch
        assert ".git/" not in patch
        assert "pyc" not in patch and "pytest_cache" not in patch and "Binary" not in patch
        assert git(checkout, "count-objects", "-v") == objects_before
        assert git(checkout, "status", "--porcelain") == ""
        assert await tree_patch(checkout, str(checkout)) == ""
    finally:
        checkouts.close()


async def test_local_session_keeps_a_commands_files_but_not_a_timed_out_ones(tmp_path: Path):
    require_tool("/usr/bin/bwrap", "bubblewrap")
    from services.sandbox.local import LocalBackend

    backend = await LocalBackend.open(max_concurrency=1, work_root=str(tmp_path), max_disk_mb=16)
    session = await backend.open_session({"seed.txt": "seed"}, LIMITS)
    try:
        # A fifo and a file the code made unreadable do not stop the folder from being kept.
        done = await session.exec(["sh", "-c", "mkfifo pipe; echo kept > a.txt; chmod 000 a.txt"], None, LIMITS)
        assert done.status is Status.PASSED, done
        assert (Path(session.work_dir) / "a.txt").read_text() == "kept\n"
        assert stat.S_ISFIFO((Path(session.work_dir) / "pipe").lstat().st_mode)  # kept as a fifo, as on docker
        short = ResourceLimits(timeout_seconds=1, memory_mb=256, cpu_seconds=5, max_output_bytes=1024)
        killed = await session.exec(["sh", "-c", "echo lost > b.txt; rm seed.txt; sleep 30"], None, short)
        assert killed.status is Status.TIMEOUT and "as before this command" in killed.error_message
        assert sorted(p.name for p in Path(session.work_dir).iterdir()) == ["a.txt", "pipe", "seed.txt"]
        sparse = "for i in 1 2; do truncate -s 15M s$i; done; echo lost > c.txt"  # 30 MB whole, 16 MB disk
        refused = await session.exec(["sh", "-c", sparse], None, LIMITS)
        assert "sparse" in refused.error_message and not (Path(session.work_dir) / "c.txt").exists()
        with pytest.raises(FileProblem) as full:
            await session.write_file("big.bin", b"x" * (17 * 1024 * 1024))
        assert full.value.kind == "full"
    finally:
        await session.close()
        await backend.close()
    assert not list(tmp_path.glob(f"{PREFIX}*"))


async def test_a_session_made_for_a_caller_who_gave_up_is_closed():
    store = SessionStore(2)
    handle, release = FakeHandle(), asyncio.Event()

    async def slow_make():
        await release.wait()
        return handle

    opening = asyncio.create_task(store.open(slow_make, limits=LIMITS, idle_timeout=60))
    await asyncio.sleep(0)
    opening.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert handle.closed and len(store) == 0


@pytest.fixture(params=["local", "docker"])
async def session_backend(request, tmp_path: Path):
    if request.param == "local":
        require_tool("/usr/bin/bwrap", "bubblewrap")
        from services.sandbox.local import LocalBackend

        backend = await LocalBackend.open(max_concurrency=2, work_root=str(tmp_path))
    else:
        require_docker()
        from services.sandbox.docker_backend import DockerBackend
        from services.sandbox.images import SANDBOX_IMAGE

        backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(tmp_path))
    yield backend
    await backend.close()


async def test_a_cancelled_command_is_killed_before_the_call_returns(session_backend):
    session = await session_backend.open_session({}, LIMITS)
    try:
        slow = ResourceLimits(timeout_seconds=120, memory_mb=256, cpu_seconds=5, max_output_bytes=1024)
        call = asyncio.create_task(session.exec(["sh", "-c", "sleep 654"], None, slow))
        count = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -cx 'sleep 654 '"
        await asyncio.sleep(1.5)  # started (a probe command here would end it: no process outlives one)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        after = await session.exec(["sh", "-c", count], None, LIMITS)
        assert after.stdout.strip() == "0", after
    finally:
        await session.close()
