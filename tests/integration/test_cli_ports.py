"""`dockyard up` serves on the ports its flags and DOCKYARD_<SVC>_PORT name, and `dockyard status`
finds that coordinator through DOCKYARD_CLI_COORDINATOR_ADDRESS, with the service token `up` created."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port
from tests.integration.test_tiny_recipe import alive_services

pytestmark = pytest.mark.slow


def test_up_binds_the_ports_of_its_flags_and_environment_and_status_follows(tmp_path: Path) -> None:
    ports = {service: free_port() for service in ("coordinator", "trainer", "rollout", "buffer", "sandbox", "endpoint")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKYARD_AUTH_TOKEN")}
    env = {**env, "DOCKYARD_TRAINER_PORT": str(ports["trainer"]), "DOCKYARD_BUFFER_PORT": str(ports["buffer"])}
    env["DOCKYARD_ENDPOINT_PORT"] = str(ports["endpoint"])  # the policy endpoint (HTTP) too
    env["DOCKYARD_COORDINATOR_STATE_DIR"] = str(tmp_path / "state")  # its own job store: no other test's jobs
    flags = [a for s in ("coordinator", "rollout", "sandbox") for a in (f"--{s}-port", str(ports[s]))]
    cmd = [sys.executable, "-m", "dockyard.cli", "up", "--log-dir", str(tmp_path), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            output.append(line)
            if line.startswith("logs in"):
                break
            assert time.monotonic() < deadline, "".join(output)
        listed = {line.split()[0]: line.split()[1] for line in output if line.split()[:1] and line[0] != " "}
        for service, port in ports.items():
            assert listed.get(service) == f"127.0.0.1:{port}", "".join(output)

        # `up` made the stack's service token (none was set) and showed where it is, not what it is.
        token_file = tmp_path / "service-token"
        shown = "".join(output)
        assert f"service token: {token_file}" in shown and token_file.read_text().strip() not in shown
        status_env = {**os.environ, "DOCKYARD_CLI_COORDINATOR_ADDRESS": f"127.0.0.1:{ports['coordinator']}"}

        def status(env: dict[str, str]) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "dockyard.cli", "status"]
            return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)

        refused = status(status_env)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        served = status({**status_env, "DOCKYARD_AUTH_TOKEN_FILE": str(token_file)})
        assert served.returncode == 0, served.stderr
        assert "no jobs" in served.stdout and "fleet:" in served.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(output) + rest
    assert alive_services(tmp_path) == []
