"""Fixtures shared by every test layer: free ports and real service processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import grpc
import pytest
from grpc.experimental.aio import init_grpc_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dockyard.rpc.ports import listens_on
from services.sandbox.images import SANDBOX_IMAGE

REPO_ROOT = Path(__file__).resolve().parent.parent

# grpc.aio stops its poller thread when its last object is freed. In a test process that object may be
# freed by the garbage collector inside a later test, after the event loop that read the poller's socket
# has closed, and the join then waits forever (grpc/grpc#40989: seen as a unit test hung in
# `torch.manual_seed`, its stack in Thread.join). One reference held here, from the main thread, for the
# process's life keeps grpc.aio from shutting down between tests.
init_grpc_aio()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HELD_PORTS: list[socket.socket] = []


def dead_address() -> str:
    """An address that refuses every connection for the rest of the test process's life.

    Its port stays bound and never listens. A port only found free (`free_port`) can be taken by a server
    another test starts meanwhile, which then answers where nothing should."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(held)
    return f"127.0.0.1:{held.getsockname()[1]}"


class ServiceProcess:
    """A real service started as `python -m services.<name>` on a free port."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        prefix = f"DOCKYARD_{name.upper()}_"
        full_env = {**os.environ, **env, f"{prefix}PORT": str(self.port)}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env=full_env,
            cwd=env.get("CWD", str(REPO_ROOT)),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_serving(self, timeout: float = 60.0) -> None:
        # Synchronous on purpose, so async tests can start services too.
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    # The answer is this process's only if the port is: another test's server can take a
                    # port found free before this one binds it (then this one exits, and is started again).
                    if (
                        reply.status == health_pb2.HealthCheckResponse.SERVING
                        and listens_on(self.proc.pid, self.port) is not False
                    ):
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start:\n{self.logs()[-4000:]}")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")


# Where each test runs under pytest-xdist (make test: XDIST workers, `--dist worksteal`). Worksteal hands worker
# k the k-th of W contiguous shares of the collected list; a worker runs its share front to back, and one that
# runs out takes the back half of the longest queue. So what heads a share starts at once and stays with its
# worker, and what ends a share is what others take. The longest test files head the shares, placed longest
# first into the share with the least expected work (the classic rule for short makespans); the rest follow,
# layer by layer (e2e, integration, contract, unit), so the quick unit tests are what the tails give away.
LAYER_ORDER = ("e2e", "integration", "contract", "unit")
# Seconds each file took in a fresh-clone CI run (three workers on 2 cores; 2026-12-06), for the placement
# only: a stale figure makes the schedule worse, never a test wrong. A tuple is one unit: files that share a
# warm start (tests/e2e/conftest.py) run back to back on one worker, not one waiting on the other's lock.
LONGEST: dict[str | tuple[str, ...], int] = {
    "tests/e2e/test_tiny_agent_external_learns.py": 1420,
    "tests/e2e/test_tiny_verifiers_learns.py": 810,
    (
        "tests/e2e/test_tiny_recipe_learns.py",
        "tests/e2e/test_tiny_recipe_jax.py",
        "tests/e2e/test_tiny_recipe_vllm.py",
    ): 600,
    "tests/e2e/test_tiny_agent_learns.py": 520,
    "tests/integration/test_kill_suite.py": 550,
    "tests/e2e/test_tiny_moe_agent.py": 250,
    "tests/integration/test_tiny_recipe.py": 210,
    "tests/unit/trainer/test_ranks.py": 400,
    "tests/integration/test_restarts.py": 150,
    "tests/e2e/test_grpo_swe.py": 150,
    "tests/e2e/test_compose.py": 150,
    "tests/integration/test_vllm_moe.py": 120,
    "tests/integration/test_coordinator_restart.py": 115,
    "tests/integration/test_humaneval_sandbox.py": 105,
    "tests/integration/test_vllm_tensor_parallel.py": 105,
    "tests/e2e/test_config_family_smoke.py": 100,
    "tests/integration/test_rollout_staging_job.py": 100,
    "tests/e2e/test_scaffold_errors.py": 90,
    "tests/e2e/test_dashboard_browser.py": 90,
    "tests/e2e/test_tiny_moe_recipe.py": 80,
    "tests/e2e/test_v4_recipe_smoke.py": 80,
}


def _layer(path: str) -> int:
    parts = path.split("/")
    return LAYER_ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in LAYER_ORDER else len(LAYER_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    paths = {item: str(item.path.relative_to(REPO_ROOT)) for item in items}
    items.sort(key=lambda item: _layer(paths[item]))  # stable: the order within a layer stays the files' own
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0] * workers
    placed: set[pytest.Item] = set()
    for unit, seconds in sorted(LONGEST.items(), key=lambda pair: -pair[1]):
        files = unit if isinstance(unit, tuple) else (unit,)
        chosen = [item for file in files for item in items if paths[item] == file]
        if not chosen:  # not collected in this run (-k, a path argument)
            continue
        k = loads.index(min(loads))
        heads[k] += chosen
        loads[k] += seconds
        placed.update(chosen)
    rest = [item for item in items if item not in placed]
    sizes, left = [], len(items)
    for k in range(workers):  # each share's size as worksteal cuts it: what is left, over the workers left
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    # The rest dealt file by file (a module's fixtures start once) to the share with the most room left, so each
    # share gets its part of every layer and ends in unit tests; a file that overflows a share goes on in the next.
    shares = [list(head) for head in heads]
    for file in dict.fromkeys(paths[item] for item in rest):
        batch = [item for item in rest if paths[item] == file]
        while batch:
            room = [sizes[k] - len(shares[k]) for k in range(workers)]
            k = room.index(max(room))
            take = len(batch) if room[k] <= 0 else min(len(batch), room[k])
            shares[k] += batch[:take]
            del batch[:take]
    items[:] = [item for share in shares for item in share]


@pytest.fixture(scope="session", autouse=True)
def coordinator_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Coordinators started by tests (LocalStack, `dockyard run`) keep job state here, never in the
    repository's runs/, so no test recovers a job another test run left behind."""
    path = tmp_path_factory.mktemp("coordinator-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOCKYARD_COORDINATOR_STATE_DIR", str(path))
        yield path


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator:
    """start_service(name, **env) -> ServiceProcess, SERVING; stopped (SIGTERM) after the test."""
    started: list[ServiceProcess] = []

    def start(name: str, env: dict[str, str] | None = None) -> ServiceProcess:
        env = dict(env or {})
        # Each test's coordinator keeps its jobs to itself unless the test shares a store on purpose.
        env.setdefault("DOCKYARD_COORDINATOR_STATE_DIR", str(tmp_path / "coordinator-state"))
        for attempt in range(1, 4):
            service = ServiceProcess(name, env, tmp_path / f"{name}-{len(started)}.log")
            started.append(service)
            try:
                service.wait_serving()
                return service
            except RuntimeError:
                # A free port can be taken between the draw and the bind (by another xdist worker's
                # process, say): draw another, as LocalStack does.
                if attempt == 3 or "cannot bind" not in service.logs():
                    raise
                service.stop()

    yield start
    for service in reversed(started):
        service.stop()


def require_tool(path: Path | str, what: str) -> str:
    """The tool's path; a missing tool skips loudly here and fails under CI=1."""
    path = Path(path)
    if path.exists():
        return str(path)
    missing(f"{what} not found at {path} (make tools installs it)")


def missing(message: str) -> NoReturn:
    """Skip loudly for what this machine lacks; under CI=1 that is a failure. Also at a module's top level,
    where it skips (or fails) the whole module."""
    if os.environ.get("CI"):
        pytest.fail(f"{message}: CI must run this test")
    pytest.skip(message, allow_module_level=True)


async def expect_code(call, code: grpc.StatusCode, *words: str) -> None:
    """Await an RPC that must fail with `code` and a message containing every word."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    for word in words:
        assert word in info.value.details()


def make_group(group_id: str, version: int = 0, job_id: str = "job-1", n: int = 2, tokens: int = 3):
    """A valid GRPO group of `n` trajectories of `tokens` completion tokens, all generated at `version`."""
    from dockyard.api.common.v1 import common_pb2

    return common_pb2.Group(
        group_id=group_id,
        job_id=job_id,
        task_id=f"task-{group_id}",
        prompt="fix the bug",
        weight_version=version,
        trajectories=[
            common_pb2.Trajectory(
                trajectory_id=f"{group_id}/{i}",
                prompt_token_ids=[1, 2],
                completion_token_ids=list(range(3, 3 + tokens)),
                completion_logprobs=[-0.1] * tokens,
                weight_version=version,
                reward=float(i),
                valid=True,
            )
            for i in range(n)
        ],
    )


class RedisServer:
    """A real redis-server on a free port, AOF on and fsynced per write, restartable on its directory.

    With `password`, it runs with --requirepass; `url` never contains the password.
    """

    def __init__(self, binary: str, directory: Path, password: str | None = None) -> None:
        self.binary = binary
        self.directory = directory
        self.password = password
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        log = open(self.directory / "redis.log", "ab")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "always", "--dir", str(self.directory)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen([self.binary, *args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                # Raw RESP: a server still replaying its AOF answers -LOADING, not +PONG.
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"PING\r\n")
                    # With --requirepass a ready server answers -NOAUTH (a loading one still says -LOADING).
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start:\n{(self.directory / 'redis.log').read_text()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown save, no AOF rewrite; only what was fsynced survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def redis_binary() -> str:
    import shutil

    return require_tool(shutil.which("redis-server") or "/usr/bin/redis-server", "redis-server")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a redis-server shared by the session; tests flush its database before use."""
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


def require_docker() -> None:
    """A docker CLI and an engine that answers; otherwise skip loudly here and fail under CI=1."""
    import shutil

    require_tool(shutil.which("docker") or "/usr/bin/docker", "docker CLI")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        missing(f"the docker engine does not answer (`docker info`: {info.stderr.strip()[-300:]})")


@pytest.fixture(scope="session")
def docker_sandbox_image() -> str:
    """The sandbox task image's tag, built offline by deploy/images/build.sh when missing (cached:
    a second build is a no-op). Use it with start_service("sandbox", docker_sandbox_env(image))."""
    require_docker()
    build = subprocess.run(
        [str(REPO_ROOT / "deploy" / "images" / "build.sh"), "--image", SANDBOX_IMAGE],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if build.returncode != 0:
        pytest.fail(f"deploy/images/build.sh failed:\n{build.stdout[-2000:]}\n{build.stderr[-4000:]}")
    return SANDBOX_IMAGE


def docker_sandbox_env(image: str, **settings: str) -> dict[str, str]:
    """Environment of a sandbox service on the docker backend; extra settings by field name."""
    env = {"DOCKYARD_SANDBOX_BACKEND": "docker", "DOCKYARD_SANDBOX_IMAGE": image}
    return env | {f"DOCKYARD_SANDBOX_{name.upper()}": value for name, value in settings.items()}


# The SWE task set the task builder makes from toolz's sdist (PyPI), shared by the tests that need one.
TOOLZ_SPEC, TOOLZ_TASK_SET = "toolz==1.0.0", "toolz-bugs"
TOOLZ_MODULE, TOOLZ_TEST_FILE = "toolz/itertoolz.py", "toolz/tests/test_itertoolz.py"


@pytest.fixture(scope="session")
def toolz_task_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task root holding TOOLZ_TASK_SET (two instances), built once per session with the CLI, as a
    user would: `dockyard tasks build-swe ...`."""
    root = tmp_path_factory.mktemp("tasks")
    cmd = [sys.executable, "-m", "dockyard.cli", "tasks", "build-swe", TOOLZ_SPEC, "--out", str(root / TOOLZ_TASK_SET)]
    cmd += ["--module", TOOLZ_MODULE, "--test-file", TOOLZ_TEST_FILE, "--max-instances", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return root
