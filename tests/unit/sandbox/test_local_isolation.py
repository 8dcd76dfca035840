"""The local backend as the service builds it: the total disk bound, refusing to run unisolated, and
isolating under an interpreter reached through a symlinked virtualenv, and the seccomp filter."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from services.sandbox.__main__ import make_backend
from services.sandbox.backend import DISK_FULL_MESSAGE, ResourceLimits, Status
from services.sandbox.settings import SandboxSettings
from tests.conftest import REPO_ROOT, require_tool

LIMITS = ResourceLimits(timeout_seconds=20.0, memory_mb=256, cpu_seconds=10.0, max_output_bytes=4096)
DISK_MB = 4  # small on purpose: no test writes more than a few MB


@pytest.fixture
async def backend(tmp_path: Path):
    require_tool(shutil.which("bwrap") or "/usr/bin/bwrap", "bubblewrap (bwrap)")
    settings = SandboxSettings(backend="local", max_concurrency=2, work_root=str(tmp_path), max_disk_mb=DISK_MB)
    backend = await make_backend(settings)
    yield backend
    await backend.close()


def zip_bomb() -> str:
    """A zip of a few KB that unpacks to 2 x DISK_MB, as the Python source that writes and unpacks it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("bomb.bin", b"\0" * (2 * DISK_MB * 1024 * 1024))
    assert len(buffer.getvalue()) < 64 * 1024
    return (
        "import zipfile\n"
        f"open('bomb.zip', 'wb').write({buffer.getvalue()!r})\n"
        "zipfile.ZipFile('bomb.zip').extractall('out')\n"
    )


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(f"open('big', 'wb').write(b'x' * {2 * DISK_MB} * 1024 * 1024)", id="one-file"),
        # Each file is far below RLIMIT_FSIZE; only their total is too much.
        pytest.param(
            f"for i in range({4 * DISK_MB}):\n    open(f'f{{i}}', 'wb').write(b'x' * 512 * 1024)", id="many-files"
        ),
        pytest.param(zip_bomb(), id="zip-bomb"),
    ],
)
async def test_total_disk_is_bounded_and_the_verdict_says_so(backend, source):
    out = await backend.execute({"main.py": source}, ["python", "main.py"], LIMITS)
    assert out.status is Status.FAILED, out
    assert "No space left on device" in out.stderr
    assert out.error_message == DISK_FULL_MESSAGE


async def test_a_full_work_folder_fails_even_when_the_code_swallows_the_error(backend):
    source = f"try:\n    open('big', 'wb').write(b'x' * {2 * DISK_MB} * 1024 * 1024)\nexcept OSError:\n    pass\n"
    out = await backend.run_tests(source, ["assert True"], LIMITS)
    assert (out.status, out.tests_passed) == (Status.FAILED, 0), out
    assert out.error_message == DISK_FULL_MESSAGE


async def test_writing_below_the_disk_limit_passes(backend):
    source = f"open('ok', 'wb').write(b'x' * {DISK_MB // 2} * 1024 * 1024)"
    out = await backend.execute({"main.py": source}, ["python", "main.py"], LIMITS)
    assert out.status is Status.PASSED, out
    assert out.error_message == ""


async def test_without_namespaces_the_service_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    settings = SandboxSettings(backend="local", max_concurrency=1, work_root=str(tmp_path))
    with pytest.raises(RuntimeError, match="cannot isolate") as refused:
        await make_backend(settings)
    assert "bwrap" in str(refused.value) and "DOCKYARD_SANDBOX_ALLOW_UNISOLATED=1" in str(refused.value)


async def test_allow_unisolated_runs_without_namespaces(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    settings = SandboxSettings(backend="local", max_concurrency=1, work_root=str(tmp_path), allow_unisolated=True)
    backend = await make_backend(settings)
    out = await backend.execute({"main.py": "print(open('/etc/hostname').read() != '')"}, ["python", "main.py"], LIMITS)
    assert (out.status, out.stdout) == (Status.PASSED, "True\n")  # the host's files: no mount namespace


def test_a_virtualenv_reached_through_a_symlink_isolates(tmp_path: Path) -> None:
    """The interpreter runs by its linked path (sys.executable): the sandbox shows that path too."""
    require_tool(shutil.which("bwrap") or "/usr/bin/bwrap", "bubblewrap (bwrap)")
    linked = tmp_path / "linked-venv"
    linked.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    python = linked / Path(sys.executable).relative_to(sys.prefix)
    probe = (
        "import asyncio, sys\n"
        "from services.sandbox.local import LocalBackend\n"
        f"assert sys.prefix == {str(linked)!r}, sys.prefix\n"
        "print('problem:', asyncio.run(LocalBackend(max_concurrency=1).isolation_problem()) or 'none')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "problem: none", done.stdout


KEYRING = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
assert platform.machine() == 'x86_64'
# add_key("user", "left", "secret", 6, KEY_SPEC_USER_KEYRING) then request_key("user", "left", NULL, 0)
added = libc.syscall(248, b'user', b'left', b'secret', 6, -4), ctypes.get_errno()
found = libc.syscall(249, b'user', b'left', None, 0), ctypes.get_errno()
print(added, found)
"""


@pytest.mark.parametrize("rpc", ["execute", "run_tests"])
async def test_the_uids_kernel_keyring_is_out_of_reach(backend, rpc):
    # One keyring per uid on the whole host: a key left there would reach every later run of the uid.
    if rpc == "execute":
        out = await backend.execute({"k.py": KEYRING}, ["python", "k.py"], LIMITS)
    else:
        out = await backend.run_tests(KEYRING, ["assert True"], LIMITS)
    assert out.status is Status.PASSED, out
    assert out.stdout.strip() == "(-1, 1) (-1, 1)"  # EPERM, both: nothing added, nothing to find
