"""`python -m dockyard.rpc.probe`, the containers' health check, against a real service.

Exit 0 while the buffer serves (whole server and its own service name), 1 for a
service name the server does not have, 1 for a port nobody listens on, and 1
once the service has stopped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, dead_address

pytestmark = pytest.mark.slow


def probe(*args: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "dockyard.rpc.probe", *args, "--timeout", "2"],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=30,
    ).returncode


def test_probe_exit_code_follows_the_health_service(start_service) -> None:
    buffer = start_service("buffer")
    assert probe(buffer.address) == 0
    assert probe(buffer.address, "dockyard.buffer.v1.BufferService") == 0
    assert probe(buffer.address, "dockyard.no.such.Service") == 1
    assert probe(dead_address()) == 1
    assert buffer.stop() == 0
    assert probe(buffer.address) == 1
