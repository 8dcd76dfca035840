"""Warm run containers (services/sandbox/docker_warm_runs.py) against the real engine: a run in one sees exactly
the confinement a cold run's container gives, output and exit code come through unchanged, and the backend's
stop leaves none behind."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import tempfile
import time

import pytest

from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.docker_warm_runs import WARM_RUN_LABEL
from tests.conftest import require_docker

pytestmark = pytest.mark.slow

LIMITS = ResourceLimits(timeout_seconds=30.0, memory_mb=256, cpu_seconds=7.0, max_output_bytes=65536)
OWNER = "dockyard.sandbox.owner"

# What the code can see of its confinement: signal dispositions (from grep, as Python ignores SIGPIPE and
# SIGXFSZ itself: a launcher that left them ignored would show in grep's), identity, capabilities, rlimits,
# the memory cgroup, mounts, network, processes.
PROBE = r"""
import os, resource, socket
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
for key in ("Uid", "Gid", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp"):
    print(key, status[key].split())
for name in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE", "RLIMIT_NPROC", "RLIMIT_NOFILE"):
    print(name, resource.getrlimit(getattr(resource, name)))
for path in ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/pids/pids.max"):
    print(path, open(path).read().strip() if os.path.exists(path) else None)
mounts = []  # sorted: the engine lists a container's mounts in no fixed order
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    if fields[4] in ("/", "/work", "/tmp", "/work/.dockyard-report"):
        mounts.append(f"mount {fields[4]} {fields[5]} {line.split(' - ')[1].split()[0]}")
print("\n".join(sorted(mounts)))
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
print("cwd", os.getcwd(), "home", os.environ.get("HOME"), "hostname", socket.gethostname())
print("processes", sum(p.isdigit() for p in os.listdir("/proc")))
print("pid 1", open("/proc/1/cmdline").read().split("\0")[:3])
print("ppid", os.getppid(), "umask", oct(os.umask(0o022)))
print("files", sorted(os.listdir(".")))
"""


def our_warm_runs(owner: str, running: bool = False) -> list[str]:
    """Ids of `owner`'s warm run containers (running: only those still running, i.e. waiting or in a run)."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-q" if running else "-aq",
            "--filter",
            f"label={WARM_RUN_LABEL}",
            "--filter",
            f"label={OWNER}={owner}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


@pytest.fixture
async def backend(docker_sandbox_image):
    require_docker()
    from services.sandbox.docker_backend import DockerBackend

    with tempfile.TemporaryDirectory(prefix="dywr-") as root:
        backend = await DockerBackend.open(
            image=docker_sandbox_image, max_concurrency=2, warm_runs=1, max_disk_mb=16, work_root=root
        )
        yield backend
        owner = backend.sessions.owner
        await backend.close()
        assert our_warm_runs(owner) == [], "the backend's stop left warm run containers"


async def until_waiting(backend, count: int = 1, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while backend.runs.waiting() < count:
        assert time.monotonic() < deadline, "no warm run container came"
        await asyncio.sleep(0.05)


async def warmed(backend, files: dict[str, str], argv: list[str]) -> list:
    """The key's first two runs (the first in its own container, the second makes the pool), once one waits."""
    outcomes = [await backend.execute(files, argv, LIMITS) for _ in range(2)]
    await until_waiting(backend)
    return outcomes


async def test_a_warm_run_sees_the_confinement_of_a_cold_one(backend):
    files = {"main.py": PROBE, "data/input.txt": "x"}
    argv = ["sh", "-c", "grep ^Sig /proc/self/status && exec python3 main.py"]
    cold, _ = await warmed(backend, files, argv)
    assert cold.status is Status.PASSED, cold
    waiting = set(our_warm_runs(backend.sessions.owner, running=True))
    warm = await backend.execute(files, argv, LIMITS)
    # The reply comes once the command ended; the container it ran in stops (and is removed) after.
    deadline = time.monotonic() + 60
    while not waiting - set(our_warm_runs(backend.sessions.owner, running=True)):
        assert time.monotonic() < deadline, "the run did not take the waiting container"
        await asyncio.sleep(0.1)
    assert warm.status is Status.PASSED, warm
    assert warm.stdout == cold.stdout
    # What the comparison covers: signal dispositions, no network, a read-only root.
    assert "SigIgn:\t0000000000000000" in cold.stdout, cold.stdout
    assert "interfaces ['lo']" in cold.stdout and "mount / ro" in cold.stdout, cold.stdout


async def test_a_warm_run_reports_exit_code_output_and_timeout_as_a_cold_one(backend):
    argv = ["sh", "-c", "echo out; echo err >&2; yes | head -c 3 >/dev/null; exit 3"]
    cold, _ = await warmed(backend, {}, argv)
    warm = await backend.execute({}, argv, LIMITS)
    for outcome in (cold, warm):
        assert (outcome.status, outcome.exit_code, outcome.stdout, outcome.stderr) == (
            Status.FAILED, 3, "out\n", "err\n"
        ), outcome  # fmt: skip
    await until_waiting(backend)
    late = await backend.execute({}, ["sleep", "30"], dataclasses.replace(LIMITS, timeout_seconds=1.0))
    assert (late.status, late.exit_code) == (Status.TIMEOUT, -9), late


async def test_a_waiting_container_that_died_is_never_scored(backend):
    await warmed(backend, {}, ["true"])
    for container_id in our_warm_runs(backend.sessions.owner, running=True):
        subprocess.run(["docker", "kill", container_id], capture_output=True)
    outcome = await backend.execute({"a.txt": "a"}, ["cat", "a.txt"], LIMITS)
    assert (outcome.status, outcome.stdout) == (Status.PASSED, "a"), outcome  # run again in its own container
