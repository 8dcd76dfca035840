"""A session opened for an external scaffold, through the real sandbox service on the docker backend:
its one network route is the endpoint it was opened for, and a hostile scaffold is contained.

The "endpoint" here is a plain HTTP server on the host's loopback (the route forwards bytes, whatever
speaks on the other end); tests/e2e/test_external_scaffold.py runs the real endpoint behind it.
"""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import threading

import grpc
import pytest

from dockyard.agents.external import run_external
from dockyard.agents.scaffold import Budget, TrialRefused
from dockyard.agents.session import SandboxSession
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.config import ScaffoldConfig
from dockyard.rpc.client import connect
from tests.conftest import docker_sandbox_env

pytestmark = pytest.mark.slow

ANSWER = b"the endpoint answers"


class _Endpoint(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def sandbox(start_service, docker_sandbox_image):
    return start_service("sandbox", docker_sandbox_env(docker_sandbox_image, docker_pids_limit="64", max_disk_mb="16"))


async def _with_session(address: str, endpoint_port: int, body, timeout: float = 20.0):
    async with connect(address) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        limits = sandbox_pb2.Limits(timeout_seconds=timeout, memory_mb=512, cpu_seconds=timeout)
        session = await SandboxSession.open(
            stub, "route-test", files={}, limits=limits, endpoint_address=f"127.0.0.1:{endpoint_port}"
        )
        try:
            return await body(session)
        finally:
            await session.close()


PROBE = """
import socket, urllib.request, os
print(sorted(name for _, name in socket.if_nameindex()))
print(urllib.request.urlopen(os.environ["URL"], timeout=10).read().decode())
for host, port in [("1.1.1.1", 53), ("127.0.0.1", {endpoint}), ("127.0.0.1", {sandbox}), ("172.17.0.1", {endpoint}),
                   ("172.17.0.1", {sandbox})]:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("connected", host, port)
    except OSError as exc:
        print("refused", host, port)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("resolved")
except OSError:
    print("no names")
try:
    open("/run/dockyard/x", "w")
    print("wrote beside the socket")
except OSError:
    print("read-only")
"""


def test_the_only_route_is_the_endpoint(sandbox, endpoint):
    async def body(session: SandboxSession):
        assert session.endpoint_url.startswith("http://127.0.0.1:")
        await session.write_file("probe.py", PROBE.format(endpoint=endpoint, sandbox=sandbox.port).encode())
        return await session.run(shell=f"URL={session.endpoint_url}/ python3 probe.py")

    result = asyncio.run(_with_session(sandbox.address, endpoint, body))
    lines = result.stdout.splitlines()
    assert result.exit_code == 0, result
    assert lines[0] == "['lo']"  # no interface but its own loopback
    assert lines[1] == ANSWER.decode()  # the endpoint, through the route
    # The internet, the host's services (the endpoint's own port, the sandbox's), the Docker bridge: none.
    assert all(line.startswith("refused") for line in lines[2:7]), lines
    assert lines[7:] == ["no names", "read-only"], lines


def test_the_route_listens_before_the_sessions_first_command(sandbox, endpoint):
    # A scaffold may connect as its very first act (no import to wait on): the session opens only
    # once PID 1's forwarder listens, so the connection never meets a closed port.
    first_act = "python3 -I -S -c \"import socket; socket.create_connection(('127.0.0.1', 8080), timeout=5)\""

    async def body(session: SandboxSession):
        return await session.run(shell=first_act)

    for _ in range(3):
        result = asyncio.run(_with_session(sandbox.address, endpoint, body))
        assert result.exit_code == 0, result


def test_a_hostile_scaffold_is_contained(sandbox, endpoint):
    """It hangs (killed at the trial's seconds), prints 100 MB (clipped), tries the network (fails):
    each run ends with a finish reason, and the same session and service go on serving."""
    budget = Budget(max_turns=3, max_tokens=512, seconds=3.0)

    async def body(session: SandboxSession):
        outcomes = []
        for command in (
            "sleep 600 & sleep 600",
            "python3 -c 'import sys; sys.stdout.write(\"x\" * (100 << 20))'",
            "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 443), timeout=2)'",
            # No stderr on success (the run's tail is its stderr, else its stdout): an image without curl
            # must not put "curl: not found" where the answer is looked for.
            'curl -s "$OPENAI_BASE_URL" 2>/dev/null || python3 -c "import os, urllib.request; '
            "print(urllib.request.urlopen(os.environ['OPENAI_BASE_URL'] + '/x').read().decode())\"",
        ):
            scaffold = ScaffoldConfig(command=command, env={"MY_SETTING": "1"})
            outcomes.append(
                await run_external(
                    session,
                    scaffold,
                    endpoint_url=session.endpoint_url,
                    api_key="dys-key",
                    model="job",
                    prompt="it's a 'task' with $(quotes)",
                    budget=budget,
                    max_new=16,
                )
            )
        count = "cat /proc/[0-9]*/comm | grep -c '^sleep$' || true"
        seen = await session.run(shell=f"sleep 60 & sleep 0.5; {count}")  # the count sees a live sleep
        left = await session.run(shell=count)
        return outcomes, seen, left

    outcomes, seen, left = asyncio.run(_with_session(sandbox.address, endpoint, body, timeout=30.0))
    hang, huge, network, allowed = (run.outcome for run in outcomes)
    huge_tail, network_tail, allowed_tail = (run.output_tail for run in outcomes[1:])
    # Each is a failure of the scaffold's own (the time limit, a non-zero exit), except the allowed call.
    assert [bool(run.error) for run in outcomes] == [True, huge.finish_reason != "exit", True, False], outcomes
    assert hang.finish_reason == "time" and hang.model_seconds < 20.0
    # 100 MB through the sandbox may outlast the 3 s: either way it ends, clipped to the session's cap.
    assert huge.finish_reason in {"exit", "time"} and 0 < len(huge_tail) <= 2000
    assert network.finish_reason == "failed" and "Network is unreachable" in network_tail, outcomes[2]
    assert allowed.finish_reason == "exit" and ANSWER.decode() in allowed_tail
    assert (seen.stdout.strip(), left.stdout.strip()) == ("1", "0")  # nothing a command started is left


def test_the_local_backend_refuses_a_routed_session(start_service):
    sandbox = start_service("sandbox", {"DOCKYARD_SANDBOX_BACKEND": "local"})

    async def open_one():
        async with connect(sandbox.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            await stub.OpenSession(
                sandbox_pb2.OpenSessionRequest(request_id="r", endpoint_address="127.0.0.1:9"), timeout=30
            )

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(open_one())
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "DOCKYARD_SANDBOX_BACKEND=docker" in caught.value.details()


def test_a_scaffold_whose_container_dies_is_an_infrastructure_error(sandbox, endpoint):
    """The container is removed under a running scaffold: TrialRefused (the trial's ERROR, masked), not a score."""

    def remove_the_session_container() -> None:
        label = "dockyard.sandbox.owner"
        for cid in subprocess.run(
            ["docker", "ps", "-q", "--filter", "label=dockyard.sandbox.session"], capture_output=True, text=True
        ).stdout.split():
            owner = subprocess.run(
                ["docker", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', cid],
                capture_output=True,
                text=True,
            ).stdout
            if f"/{sandbox.proc.pid}/" in owner:
                subprocess.run(["docker", "rm", "-f", cid], capture_output=True)

    async def body(session: SandboxSession):
        running = asyncio.ensure_future(
            run_external(
                session,
                ScaffoldConfig(command="sleep 60"),
                endpoint_url=session.endpoint_url,
                api_key="k",
                model="job",
                prompt="p",
                budget=Budget(max_turns=1, max_tokens=64, seconds=30.0),
                max_new=8,
            )
        )
        await asyncio.sleep(2.0)
        await asyncio.to_thread(remove_the_session_container)
        with pytest.raises(TrialRefused, match="sandbox failed"):
            await running

    asyncio.run(_with_session(sandbox.address, endpoint, body, timeout=40.0))
