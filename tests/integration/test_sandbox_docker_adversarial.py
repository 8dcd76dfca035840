"""Hostile code against the docker backend, through the real sandbox service: one property per test.

Each test starts the service on the docker backend, runs one attack, checks the
one property it is about, and then checks that the same service still scores an
ordinary task correctly. The attacks run in warm run containers (docker_warm_runs.py: the fixture, and
the memory test for its own limit, warm their key first and wait for a waiting container), the path a
scored task takes; a service's first run of a key, and still_serves' first calls, start their own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from services.sandbox.backend import DISK_FULL_MESSAGE
from services.sandbox.docker_warm_runs import LAUNCHER_COMMAND, WARM_RUN_LABEL
from tests.conftest import docker_sandbox_env

pytestmark = pytest.mark.slow

PASSED = common_pb2.VERDICT_STATUS_PASSED
FAILED = common_pb2.VERDICT_STATUS_FAILED
TIMEOUT = common_pb2.VERDICT_STATUS_TIMEOUT
LABEL = "dockyard.sandbox.owner"
DISK_MB = 8  # the service's DOCKYARD_SANDBOX_MAX_DISK_MB: small, so no test writes much


async def _call(address: str, method: str, request):
    async with connect(address) as channel:
        return await getattr(sandbox_pb2_grpc.SandboxServiceStub(channel), method)(request, timeout=120)


def python(service, source: str, **limits) -> common_pb2.Verdict:
    request = sandbox_pb2.ExecuteRequest(
        files={"main.py": source}, command=["python", "main.py"], limits=sandbox_pb2.Limits(**limits)
    )
    return asyncio.run(_call(service.address, "Execute", request)).verdict


def run_tests(service, program: str, tests: list[str], **limits) -> common_pb2.Verdict:
    request = sandbox_pb2.RunTestsRequest(program=program, tests=tests, limits=sandbox_pb2.Limits(**limits))
    return asyncio.run(_call(service.address, "RunTests", request)).verdict


def still_serves(service) -> None:
    verdict = run_tests(
        service, "def add(a, b):\n    return a + b\n", ["assert add(2, 3) == 5", "assert add(1, 1) == 3"]
    )
    assert (verdict.status, verdict.tests_passed, verdict.tests_total) == (FAILED, 1, 2), verdict
    verdict = python(service, "print('still here')")
    assert (verdict.status, verdict.stdout) == (PASSED, "still here\n"), verdict


def waiting_warm_run(container: dict) -> bool:
    """Whether a container is a warm run container still waiting for its run: running, and its PID 1 still
    the launcher (a run's execs the run's command, and an ended one runs nothing)."""
    if WARM_RUN_LABEL not in (container["Config"]["Labels"] or {}) or not container["State"]["Running"]:
        return False
    try:
        cmdline = Path(f"/proc/{container['State']['Pid']}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:  # it ended since the inspect (a run's reply comes before its container stops)
        return False
    return cmdline[:5] == [arg.encode() for arg in LAUNCHER_COMMAND]


def our_containers(service, seconds: float = 15.0) -> list[str]:
    """Ids of containers the service (by its pid) still has, other than warm run containers still waiting
    for their run; waits up to `seconds` for the list to empty (an ended run's container is removed right
    after its verdict is sent)."""
    deadline = time.monotonic() + seconds
    while True:
        out = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={LABEL}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        owned = []
        for cid in out:
            found = subprocess.run(["docker", "inspect", cid], capture_output=True, text=True)
            if found.returncode != 0:
                continue  # removed meanwhile
            container = json.loads(found.stdout)[0]
            if f"/{service.proc.pid}/" in container["Config"]["Labels"].get(LABEL, ""):
                if not waiting_warm_run(container):
                    owned.append(cid)
        if not owned or time.monotonic() > deadline:
            return owned
        time.sleep(0.2)


def waiting_for(service, memory_mb: int) -> set[str]:
    """Ids of the service's warm run containers of `memory_mb` waiting for their run."""
    out = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label={WARM_RUN_LABEL}"], capture_output=True, text=True, check=True
    ).stdout.split()
    if not out:
        return set()
    found = subprocess.run(["docker", "inspect", *out], capture_output=True, text=True)
    return {
        c["Id"]
        for c in json.loads(found.stdout or "[]")
        if f"/{service.proc.pid}/" in c["Config"]["Labels"].get(LABEL, "")
        and c["HostConfig"]["Memory"] == memory_mb * 1024 * 1024
        and waiting_warm_run(c)
    }


def warm_up(service, memory_mb: int = 512) -> set[str]:
    """Runs of the key (the default image, `memory_mb`, default CPU seconds) until one waits warm; its ids."""
    for _ in range(2):  # a key gets its pool at its second run
        assert python(service, "pass", memory_mb=memory_mb).status == PASSED
    deadline = time.monotonic() + 60
    while not (waiting := waiting_for(service, memory_mb)):
        assert time.monotonic() < deadline, "no warm run container came"
        time.sleep(0.2)
    return waiting


@pytest.fixture
def sandbox(start_service, docker_sandbox_image):
    service = start_service(
        "sandbox", docker_sandbox_env(docker_sandbox_image, docker_pids_limit="64", max_disk_mb=str(DISK_MB))
    )
    warm_up(service)
    return service


def test_a_run_takes_a_waiting_container_and_is_removed(sandbox):
    # A container shows its launcher as PID 1 (what waiting_for sees) a moment before the service has read the
    # launcher's READY and put it in its pool; a run in that moment starts its own (CI saw it under load). So
    # up to five runs, each of which must pass, until one takes a container seen waiting before it.
    for _ in range(5):
        waiting = waiting_for(sandbox, 512)
        verdict = python(sandbox, "print('warm')")
        assert (verdict.status, verdict.stdout) == (PASSED, "warm\n"), verdict  # the launcher's GO is not output
        if waiting - waiting_for(sandbox, 512):
            break
        time.sleep(1.0)
    else:
        pytest.fail("none of five runs took a container that was waiting before it")
    assert our_containers(sandbox) == []


def test_no_network(sandbox):
    port = sandbox.port  # the service itself listens on the host's loopback
    source = f"""
import socket
print(sorted(name for _, name in socket.if_nameindex()))
for host, port in [("1.1.1.1", 53), ("8.8.8.8", 443), ("127.0.0.1", {port}), ("172.17.0.1", {port})]:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("connected", host, port)
    except OSError as exc:
        print("refused", host, port, type(exc).__name__)
"""
    verdict = python(sandbox, source)
    assert verdict.status == PASSED, verdict
    lines = verdict.stdout.splitlines()
    assert lines[0] == "['lo']", verdict.stdout
    assert len(lines) == 5 and all(line.startswith("refused") for line in lines[1:]), verdict.stdout
    still_serves(sandbox)


def test_no_write_outside_the_work_folder(sandbox, tmp_path):
    host_marker = tmp_path / f"host-{uuid.uuid4().hex}"
    host_marker.write_text("host secret")
    source = f"""
import os
for path in ["/etc/evil", "/usr/bin/evil", "/opt/venv/evil", "/evil", "/home/sandbox/evil", "/var/tmp/evil"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as exc:
        print("denied", path, exc.errno)
open("/work/ok", "w").write("fine")
open("/tmp/ok", "w").write("fine")
print("host file visible:", os.path.exists({str(host_marker)!r}))
print("uid", os.getuid())
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("CapEff", status["CapEff"].strip(), "NoNewPrivs", status["NoNewPrivs"].strip())
"""
    verdict = python(sandbox, source)
    assert verdict.status == PASSED, verdict
    lines = verdict.stdout.splitlines()
    assert all(line.startswith("denied") for line in lines[:6]), verdict.stdout
    assert lines[6:] == ["host file visible: False", "uid 1000", "CapEff 0000000000000000 NoNewPrivs 1"]
    assert host_marker.read_text() == "host secret"
    still_serves(sandbox)


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(f"open('big', 'wb').write(b'x' * {2 * DISK_MB} * 1024 * 1024)", id="one-file"),
        # Each file is far below RLIMIT_FSIZE; only their total is too much.
        pytest.param(
            f"for i in range({4 * DISK_MB}):\n    open(f'f{{i}}', 'wb').write(b'x' * 512 * 1024)", id="many-files"
        ),
        pytest.param(
            "import zipfile\n"
            "with zipfile.ZipFile('/tmp/bomb.zip', 'w', zipfile.ZIP_DEFLATED) as z:\n"
            f"    z.writestr('bomb.bin', bytes({2 * DISK_MB} * 1024 * 1024))\n"
            "zipfile.ZipFile('/tmp/bomb.zip').extractall('out')\n",
            id="zip-bomb",
        ),
    ],
)
def test_total_disk_in_work_is_bounded(sandbox, source):
    verdict = python(sandbox, source)
    assert verdict.status == FAILED, verdict
    assert "No space left on device" in verdict.stderr
    assert verdict.error_message == DISK_FULL_MESSAGE
    still_serves(sandbox)


def test_fork_bomb_is_contained(sandbox):
    # Counts how many processes it can hold at once, then keeps forking until the deadline.
    source = """
import os, time
children = 0
try:
    while children < 1000:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as exc:
    print("fork refused after", children, type(exc).__name__, flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    verdict = python(sandbox, source, timeout_seconds=4)
    assert verdict.status == TIMEOUT, verdict
    refused = verdict.stdout.split()
    assert refused[:3] == ["fork", "refused", "after"], verdict.stdout
    assert 0 < int(refused[3]) < 64  # the pids limit the service was given
    assert verdict.duration_seconds < 15
    assert our_containers(sandbox) == []
    still_serves(sandbox)


def test_memory_hog_is_killed(sandbox):
    warm_up(sandbox, memory_mb=128)
    source = """
chunks = []
while True:
    chunks.append(b"x" * (16 * 1024 * 1024))
"""
    verdict = python(sandbox, source, memory_mb=128, timeout_seconds=30)
    assert (verdict.status, verdict.exit_code) == (FAILED, -9), verdict
    assert verdict.duration_seconds < 20
    still_serves(sandbox)


def test_infinite_loop_times_out(sandbox):
    verdict = run_tests(sandbox, "while True:\n    pass\n", ["assert True"], timeout_seconds=2)
    assert (verdict.status, verdict.tests_passed, verdict.tests_total) == (TIMEOUT, 0, 1), verdict
    assert 2 <= verdict.duration_seconds < 10
    assert our_containers(sandbox) == []
    still_serves(sandbox)


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_100_mb_print_is_capped(sandbox):
    before = _peak_rss_kb(sandbox.proc.pid)
    source = (
        "import sys\nfor _ in range(100):\n    sys.stdout.write('y' * (1024 * 1024))\nprint('done', file=sys.stderr)\n"
    )
    verdict = python(sandbox, source, max_output_bytes=4096, timeout_seconds=60)
    assert verdict.status == PASSED, verdict.stderr
    assert (len(verdict.stdout), set(verdict.stdout), verdict.output_truncated) == (4096, {"y"}, True)
    assert verdict.stderr == "done\n"  # the whole stream was drained to its end
    # The service kept 4 KiB, not 100 MB: its peak memory grew by far less than the output.
    assert _peak_rss_kb(sandbox.proc.pid) - before < 40 * 1024
    still_serves(sandbox)


def test_the_report_cannot_be_forged(sandbox):
    program = """
import os, sys
print("0" * 32 + " result 1")
sys.stderr.write("0" * 32 + " result 1\\n")
print("input visible:", os.path.exists(".dockyard-input"))
with open(".dockyard-report", "w") as report:
    report.write("deadbeef result 1\\n")
os._exit(0)
"""
    verdict = run_tests(sandbox, program, ["assert False"])
    assert (verdict.status, verdict.tests_passed, verdict.tests_total) == (FAILED, 0, 1), verdict
    assert "input visible: False" in verdict.stdout
    still_serves(sandbox)


def test_a_new_service_reaps_containers_of_a_dead_one(start_service, docker_sandbox_image):
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no live process
    label = f"{socket.gethostname()}/{dead.pid}/1"
    leftover = subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--network",
            "none",
            "--label",
            f"{LABEL}={label}",
            docker_sandbox_image,
            "sleep",
            "300",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        service = start_service("sandbox", docker_sandbox_env(docker_sandbox_image))
        gone = subprocess.run(["docker", "inspect", leftover], capture_output=True)
        assert gone.returncode != 0, "the dead service's container is still there"
        still_serves(service)
    finally:
        subprocess.run(["docker", "rm", "-f", leftover], capture_output=True)


def test_every_run_s_container_is_removed(sandbox):
    async def burst():
        request = sandbox_pb2.ExecuteRequest(command=["sh", "-c", "sleep 0.5; echo ok"])
        return await asyncio.gather(*(_call(sandbox.address, "Execute", request) for _ in range(4)))

    replies = asyncio.run(burst())
    assert [r.verdict.stdout for r in replies] == ["ok\n"] * 4, [str(r.verdict) for r in replies]
    assert our_containers(sandbox) == []
    assert sandbox.proc.poll() is None  # the service is still up


def test_a_caller_that_gives_up_ends_its_container(sandbox):
    async def give_up():
        async with connect(sandbox.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            request = sandbox_pb2.ExecuteRequest(command=["sleep", "60"], limits=sandbox_pb2.Limits(timeout_seconds=60))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Execute(request, timeout=2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    asyncio.run(give_up())
    assert our_containers(sandbox) == [], "the container outlived its cancelled call"
    still_serves(sandbox)
