"""A service that cannot start says why in one line, and a stopped service exits at once with status 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dockyard.rpc.client import wait_until_serving

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _service(name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{name}"],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def test_a_port_in_use_is_one_line_naming_it() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _service("buffer", {"DOCKYARD_BUFFER_PORT": str(port)})
        _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert f"cannot bind 127.0.0.1:{port}" in err and "Traceback" not in err, err


def test_a_port_another_service_serves_on_is_refused_not_shared() -> None:
    # gRPC's default SO_REUSEPORT would let the second server bind and take a share of the first's calls.
    port = _free_port()
    first = _service("buffer", {"DOCKYARD_BUFFER_PORT": str(port)})
    started = [first]
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", 120))
        second = _service("coordinator", {"DOCKYARD_COORDINATOR_PORT": str(port)})
        started.append(second)
        try:
            _, err = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a second service bound port {port}, which a running service holds, and serves")
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
    assert second.returncode != 0
    assert f"coordinator: cannot bind 127.0.0.1:{port}" in err and "Traceback" not in err, err


def test_the_docker_backend_without_an_engine_is_one_line_with_the_fix(tmp_path: Path) -> None:
    env = {
        "DOCKYARD_SANDBOX_BACKEND": "docker",
        "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
        "DOCKYARD_SANDBOX_PORT": str(_free_port()),
        "DOCKYARD_SANDBOX_WORK_ROOT": str(tmp_path / "work"),
    }
    proc = _service("sandbox", env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "needs a Docker engine" in err and "start the Docker daemon" in err, err
    # The service serves jobs it does not know yet: the local backend only for those that need no container.
    assert "only a job that needs no container can use the local backend" in err, err
    assert "env.scaffold" in err and "terminal_bench" in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("name", ["trainer", "rollout"])
def test_a_stopped_service_exits_promptly_with_status_zero(name: str) -> None:
    port = _free_port()
    proc = _service(name, {f"DOCKYARD_{name.upper()}_PORT": str(port)})
    try:
        asyncio.run(wait_until_serving(f"127.0.0.1:{port}", 120))
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)  # dockyard.stack's grace: past it the service would be SIGKILLed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert time.monotonic() - start < 15
