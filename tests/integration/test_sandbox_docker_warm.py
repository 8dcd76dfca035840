"""Warm docker sessions (services/sandbox/docker_warm.py) against the real engine: taken warm, replaced in
the background, a dead waiting container never handed out, per-session limits, the same lockdown as a
cold session, a routed warm session, drained at a job's end and at the service's stop; a session's exec and
a run's shell that stay alive until the host has their end lines (the engine drops an exited process's late
output); and 32 sessions at once through the real service."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.docker_container import STAGE_COMMAND, end_stdin
from services.sandbox.docker_sessions import COMMAND_WRAPPER
from services.sandbox.docker_warm import WARM_LABEL
from services.sandbox.endpoint_route import MOUNT, SOCKET_NAME
from tests.conftest import docker_sandbox_env, require_docker

pytestmark = pytest.mark.slow

LIMITS = ResourceLimits(timeout_seconds=30.0, memory_mb=256, cpu_seconds=10.0, max_output_bytes=65536)
OWNER = "dockyard.sandbox.owner"


def inspect(container_id: str) -> dict:
    out = subprocess.run(["docker", "inspect", container_id], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def warm_containers(owner: str) -> list[str]:
    """Ids of the warm containers (waiting or taken) `owner` (a backend's label) has, running or not."""
    out = subprocess.run(
        ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label={WARM_LABEL}", "--filter", f"label={OWNER}={owner}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


async def until(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


@pytest.fixture
async def backend(docker_sandbox_image):
    require_docker()
    from services.sandbox.docker_backend import DockerBackend

    # A short work root: a routed session's socket path (work root + its folder) must fit a unix socket's
    # 108 bytes, which a test's tmp_path under a long test name does not.
    with tempfile.TemporaryDirectory(prefix="dyw-") as root:
        backend = await DockerBackend.open(
            image=docker_sandbox_image, max_concurrency=4, warm_max=4, max_disk_mb=16, work_root=root
        )
        yield backend
        owner = backend.sessions.owner
        await backend.close()
        assert warm_containers(owner) == [], "the service's stop left warm containers"


async def test_a_session_is_taken_warm_and_replaced_in_the_background(backend):
    assert await backend.prepare_sessions("job-a", 2, LIMITS) == 2
    await until(lambda: backend.warm.waiting() == 2)
    owner = backend.sessions.owner
    before = set(warm_containers(owner))  # no session open yet: exactly the waiting ones
    assert len(before) == 2
    session = await backend.open_session({"task.txt": "the task\n", "sub/b.txt": "b"}, LIMITS)
    later = []
    try:
        assert session.container_id in before  # a container that was waiting, not one started for it
        outcome = await session.exec(["sh", "-c", "cat task.txt sub/b.txt; id -u; pwd"], None, LIMITS)
        assert outcome.status is Status.PASSED, outcome
        assert outcome.stdout.splitlines() == ["the task", "b" + backend.sessions.user.split(":")[0], "/work"]
        await until(lambda: backend.warm.waiting() == 2)  # its replacement started meanwhile
        replacements = set(warm_containers(owner)) - before
        assert len(replacements) == 1
        # The next two sessions take what waits: the other first container and the replacement, never the taken one.
        later = [await backend.open_session({}, LIMITS), await backend.open_session({}, LIMITS)]
        assert {s.container_id for s in later} == (before - {session.container_id}) | replacements
    finally:
        for opened in (session, *later):
            await opened.close()


async def test_a_warm_container_is_locked_down_as_a_cold_one(backend):
    await backend.prepare_sessions("job-a", 1, LIMITS)
    await until(lambda: backend.warm.waiting() == 1)
    warm = await backend.open_session({}, LIMITS)
    cold = await backend.open_session({}, ResourceLimits(30.0, 300, 10.0, 65536))  # no pool for this key
    try:
        assert warm.container_id in set(warm_containers(backend.sessions.owner))
        assert cold.container_id not in set(warm_containers(backend.sessions.owner))
        assert (warm.warm, cold.warm) == (True, False)  # what the "session opened" log line says
        fields = ("ReadonlyRootfs", "CapDrop", "SecurityOpt", "NetworkMode", "PidsLimit", "Tmpfs", "Ulimits", "Binds")
        warm_host, cold_host = inspect(warm.container_id)["HostConfig"], inspect(cold.container_id)["HostConfig"]
        assert {f: warm_host[f] for f in fields} == {f: cold_host[f] for f in fields}
        assert warm_host["ReadonlyRootfs"] is True and warm_host["NetworkMode"] == "none"
        assert warm_host["CapDrop"] == ["ALL"] and "size=16m" in warm_host["Tmpfs"]["/work"]
        assert inspect(warm.container_id)["Config"]["User"] == inspect(cold.container_id)["Config"]["User"] != "0:0"
        # What the warm one's PID 1 left in /work: nothing; writes outside /work and /tmp refused.
        outcome = await warm.exec(["sh", "-c", "ls -A /work; touch /etc/x || echo refused"], None, LIMITS)
        assert outcome.stdout == "refused\n", outcome
    finally:
        await warm.close()
        await cold.close()


async def test_a_sessions_writes_stay_in_its_bounded_tmpfs_folders_never_on_the_hosts_disk(backend):
    await backend.prepare_sessions("job-a", 1, LIMITS)
    await until(lambda: backend.warm.waiting() == 1)
    session = await backend.open_session({}, LIMITS)
    try:
        folders = "/ /etc /home /opt /root /run /var /var/tmp /usr /work /tmp /dev/shm"
        probe = f"for d in {folders}; do head -c 1048576 /dev/zero >$d/fill 2>/dev/null && echo $d; done"
        outcome = await session.exec(["sh", "-c", probe], None, LIMITS)
        assert outcome.stdout.split() == ["/work", "/tmp", "/dev/shm"], outcome  # all three tmpfs (memory)
        # /work holds at most max_disk_mb (16): more is refused and the command FAILED, disk limit.
        outcome = await session.exec(["sh", "-c", "head -c 20000000 /dev/zero >big"], None, LIMITS)
        assert outcome.status is Status.FAILED and "disk limit" in outcome.error_message, outcome
        size_rw = ["docker", "inspect", "-s", "-f", "{{.SizeRw}}", session.container_id]
        sizes = subprocess.run(size_rw, capture_output=True)
        assert sizes.stdout.strip() == b"0"  # the container's writable layer: nothing written
    finally:
        await session.close()


async def test_each_session_gets_its_own_limits(backend):
    small, large = LIMITS, ResourceLimits(30.0, 384, 20.0, 65536)
    await backend.prepare_sessions("job-a", 1, small)
    await backend.prepare_sessions("job-b", 1, large)
    await until(lambda: backend.warm.waiting() == 2)
    sessions = [await backend.open_session({}, small), await backend.open_session({}, large)]
    try:
        warm = set(warm_containers(backend.sessions.owner))
        for session, limits in zip(sessions, (small, large), strict=True):
            assert session.container_id in warm
            host = inspect(session.container_id)["HostConfig"]
            assert host["Memory"] == host["MemorySwap"] == limits.memory_mb * 1024 * 1024
            cpu = next(u for u in host["Ulimits"] if u["Name"] == "cpu")
            assert cpu["Soft"] == int(limits.cpu_seconds)
            outcome = await session.exec(["sh", "-c", "ulimit -t"], None, limits)
            assert outcome.stdout.strip() == str(int(limits.cpu_seconds)), outcome
    finally:
        for session in sessions:
            await session.close()


@pytest.mark.parametrize("files", [{"f.txt": "alive"}, {}], ids=["files copied in", "no files"])
async def test_a_container_that_died_while_waiting_is_never_handed_out(backend, files):
    await backend.prepare_sessions("job-a", 2, LIMITS)
    await until(lambda: backend.warm.waiting() == 2)
    dead = sorted(warm_containers(backend.sessions.owner))  # no session open yet: exactly the waiting ones
    assert len(dead) == 2
    for container_id in dead:  # both die while waiting: the take finds none alive
        subprocess.run(["docker", "kill", container_id], capture_output=True, check=True)
    session = await backend.open_session(files, LIMITS)
    try:
        assert session.container_id not in dead
        outcome = await session.exec(["sh", "-c", "cat f.txt 2>/dev/null || printf alive"], None, LIMITS)
        assert (outcome.status, outcome.stdout) == (Status.PASSED, "alive"), outcome
        await until(lambda: all(subprocess.run(["docker", "inspect", c], capture_output=True).returncode for c in dead))
    finally:
        await session.close()


async def test_a_routed_warm_session_reaches_its_own_endpoint_only_once_taken(backend):
    async def answer(reader, writer):
        await reader.readline()
        writer.write(b"endpoint says hi\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    await backend.prepare_sessions("job-a", 1, LIMITS, routed=True)
    await until(lambda: backend.warm.waiting() == 1)
    (waiting,) = warm_containers(backend.sessions.owner)  # no session open yet: the one waiting
    mounts = {m["Destination"]: m["Source"] for m in inspect(waiting)["Mounts"]}
    assert os.listdir(mounts[MOUNT]) == []  # its route's folder made and mounted; no address, no socket yet
    session = await backend.open_session({}, LIMITS, endpoint_address=f"127.0.0.1:{port}")
    try:
        assert session.container_id == waiting
        assert os.listdir(mounts[MOUNT]) == [SOCKET_NAME]  # bound and listening once taken
        source = (
            "import socket; s = socket.create_connection(('127.0.0.1', 8080), timeout=10); s.sendall(b'hi\\n'); "
            "print(s.makefile().readline().strip())"
        )
        outcome = await session.exec(["python3", "-c", source], None, LIMITS)
        assert (outcome.status, outcome.stdout) == (Status.PASSED, "endpoint says hi\n"), outcome
    finally:
        await session.close()
        server.close()


async def test_a_jobs_end_drains_its_pool_and_only_its_own(backend):
    await backend.prepare_sessions("job-a", 2, LIMITS)
    await backend.prepare_sessions("job-b", 1, LIMITS)  # the same key: one pool of both shares
    await until(lambda: backend.warm.waiting() == 3)
    await backend.release_sessions("job-a")
    assert backend.warm.waiting() == 1
    await backend.release_sessions("job-b")
    assert backend.warm.waiting() == 0 and backend.warm.sizes() == {}
    assert warm_containers(backend.sessions.owner) == []


@pytest.mark.parametrize("when", ["waiting", "starting"])
async def test_the_services_stop_leaves_no_warm_container(docker_sandbox_image, when):
    require_docker()
    from services.sandbox.docker_backend import DockerBackend

    backend = await DockerBackend.open(image=docker_sandbox_image, max_concurrency=2, warm_max=3, max_disk_mb=16)
    await backend.prepare_sessions("job-a", 3, LIMITS)
    if when == "waiting":
        await until(lambda: backend.warm.waiting() == 3)
        assert len(warm_containers(backend.sessions.owner)) == 3
    # "starting": the starts are under way, none finished: close awaits each and removes it
    await backend.close()
    assert warm_containers(backend.sessions.owner) == []


async def _open_exec_close(stub, i: int) -> common_pb2.Verdict:
    limits = sandbox_pb2.Limits(timeout_seconds=60, memory_mb=256)
    opened = await stub.OpenSession(
        sandbox_pb2.OpenSessionRequest(request_id=f"r{i}", files={"n.txt": str(i)}, limits=limits), timeout=300
    )
    try:
        reply = await stub.SessionExec(
            sandbox_pb2.SessionExecRequest(session_id=opened.session_id, shell="cat n.txt; echo; ls /tmp | wc -l"),
            timeout=300,
        )
        return reply.verdict
    finally:
        await stub.CloseSession(sandbox_pb2.CloseSessionRequest(session_id=opened.session_id), timeout=120)


async def test_an_exec_stays_alive_until_the_host_has_both_end_lines(backend):
    session = await backend.open_session({"a.txt": "a"}, LIMITS)
    try:
        await asyncio.to_thread(_handshake, session.container_id, inspect(session.container_id)["Config"]["User"])
    finally:
        await session.close()


def _handshake(container_id: str, user: str) -> None:
    """COMMAND_WRAPPER driven by hand: its stdin (end token, size, data), its end lines, then its exit, which
    waits for stdin's end however long the host takes to send it."""
    import socket

    import docker
    from docker.utils.socket import frames_iter

    api = docker.from_env().api
    token = b"0123456789abcdef0123456789abcdef"
    argv = ["sh", "-c", COMMAND_WRAPPER, "sh", "sh", "-c", "cat; echo warn >&2; exit 3"]
    exec_id = api.exec_create(container_id, argv, stdin=True, user=user, workdir="/work")["Id"]
    sock = api.exec_start(exec_id, socket=True)
    raw = getattr(sock, "_sock", sock)
    raw.sendall(token + b" 4\ndata")
    end = token + b" 3 0\n"
    seen, frames = {1: b"", 2: b""}, frames_iter(sock, tty=False)
    for stream, data in frames:
        seen[stream] += data
        if seen[1].endswith(end) and seen[2].endswith(end):
            break
    assert seen == {1: b"data" + end, 2: b"warn\n" + end}
    time.sleep(1.0)
    state = api.exec_inspect(exec_id)
    assert state["Running"], "the exec exited before the host ended its stdin"
    raw.shutdown(socket.SHUT_WR)
    assert b"".join(data for _, data in frames) == b""  # then the engine ends the stream: the exec exited
    sock.close()
    state = api.exec_inspect(exec_id)
    assert (state["Running"], state["ExitCode"]) == (False, 3)


def test_a_runs_shell_stays_alive_until_the_host_ends_its_stdin(docker_sandbox_image):
    """STAGE_COMMAND in a run's container: its end lines, then its exit only once stdin ends."""
    require_docker()
    import docker

    api = docker.from_env().api
    argv = ["sh", "-c", STAGE_COMMAND, "sh", "sh", "-c", "echo out; echo warn >&2; exit 5"]
    container_id = api.create_container(docker_sandbox_image, command=argv, stdin_open=True, working_dir="/tmp")["Id"]
    try:
        stream = api.attach(container_id, stdout=True, stderr=True, stream=True, logs=False, demux=True)
        stdin = api.attach_socket(container_id, params={"stdin": 1, "stream": 1})
        api.start(container_id)
        token = b"0123456789abcdef0123456789abcdef"
        getattr(stdin, "_sock", stdin).sendall(token + b" 0\n")  # no files: no tar
        end = token + b" 5 0\n"
        seen = [b"", b""]
        for chunk_out, chunk_err in stream:
            seen = [seen[0] + (chunk_out or b""), seen[1] + (chunk_err or b"")]
            if seen[0].endswith(end) and seen[1].endswith(end):
                break
        assert seen == [b"out\n" + end, b"warn\n" + end]
        time.sleep(1.0)
        assert inspect(container_id)["State"]["Running"], "the run's shell exited before its stdin ended"
        end_stdin(stdin)
        assert api.wait(container_id, timeout=30)["StatusCode"] == 5
    finally:
        subprocess.run(["docker", "rm", "-f", container_id], capture_output=True)


def test_32_sessions_at_once_open_exec_and_close_without_errors(start_service, docker_sandbox_image):
    require_docker()
    env = docker_sandbox_env(
        docker_sandbox_image, max_sessions="32", warm_sessions_max="32", max_disk_mb="16", max_concurrency="32"
    )
    service = start_service("sandbox", env)

    async def main() -> list[common_pb2.Verdict]:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            limits = sandbox_pb2.Limits(timeout_seconds=60, memory_mb=256)
            prepared = await stub.PrepareSessions(
                sandbox_pb2.PrepareSessionsRequest(job_id="job-32", size=32, limits=limits), timeout=600
            )
            assert prepared.warm == 32
            verdicts = await asyncio.gather(*(_open_exec_close(stub, i) for i in range(32)))
            await stub.ReleaseSessions(sandbox_pb2.ReleaseSessionsRequest(job_id="job-32"), timeout=300)
            return verdicts

    verdicts = asyncio.run(main())
    for i, verdict in enumerate(verdicts):
        assert verdict.status == common_pb2.VERDICT_STATUS_PASSED, verdict
        assert verdict.stdout == f"{i}\n0\n", verdict  # its own files, an empty /tmp
    # Each warm container's owner label in the one listing: other tests' services start and remove theirs
    # meanwhile, so a container listed here may be gone by the time a second call would inspect it.
    owner_of = f'{{{{.Label "{OWNER}"}}}}'
    left = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label={WARM_LABEL}", "--format", owner_of],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    owned = [owner for owner in left if f"/{service.proc.pid}/" in owner]
    assert owned == [], "ReleaseSessions left warm containers"
