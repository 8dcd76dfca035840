"""The buffer and the coordinator's job store on a password-protected Redis (redis-server --requirepass).

The right password, in the URL or in DOCKYARD_<SVC>_..._PASSWORD_FILE,
works; a wrong or missing one, or one given twice, stops the service at
startup with a message that says what to set and never shows the password.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.experience.data_plane import PASSWORD_VARIABLE, DataPlane
from dockyard.redis_url import RedisConfigError, mask_url, read_password
from dockyard.rpc.client import connect
from tests.conftest import REPO_ROOT, RedisServer, free_port, make_group, redis_binary

PASSWORD = "pw-Redis-7f3a9c"


@pytest.fixture(scope="module")
def protected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis-auth"), password=PASSWORD)
    server.start()
    yield server
    server.stop()


def with_password(url: str, password: str) -> str:
    return url.replace("redis://", f"redis://:{password}@")


def test_mask_url_hides_only_the_password() -> None:
    assert mask_url(f"redis://:{PASSWORD}@redis:6379/0") == "redis://:***@redis:6379/0"
    assert mask_url(f"rediss://app:{PASSWORD}@[::1]:6380/2") == "rediss://app:***@[::1]:6380/2"
    assert mask_url("redis://redis:6379/0") == "redis://redis:6379/0"


def test_password_in_one_place_only(tmp_path: Path) -> None:
    variable = "DOCKYARD_BUFFER_REDIS_PASSWORD"
    url = "redis://127.0.0.1:6379/0"
    assert read_password(with_password(url, PASSWORD), "", "", variable) is None  # the URL carries it
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    assert read_password(url, "", str(tmp_path / "pw"), variable) == PASSWORD
    with pytest.raises(RedisConfigError, match="one place only") as info:
        read_password(with_password(url, PASSWORD), PASSWORD, "", variable)
    assert PASSWORD not in str(info.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RedisConfigError, match="empty"):
        read_password(url, "", str(tmp_path / "empty"), variable)
    with pytest.raises(RedisConfigError, match="no such file"):
        read_password(url, "", str(tmp_path / "absent"), variable)


def buffer_env(url: str, **extra: str) -> dict[str, str]:
    return {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": url, **extra}


async def put_one(address: str, job_id: str) -> int:
    async with connect(address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.OpenJob(buffer_pb2.OpenJobRequest(job_id=job_id, max_groups=4, max_trajectory_age_steps=1))
        await stub.PutGroup(buffer_pb2.PutGroupRequest(group=make_group("g1", job_id=job_id)))
        return (await stub.GetStats(buffer_pb2.GetStatsRequest(job_id=job_id))).held


async def test_right_password_in_the_url_or_a_file(start_service, protected: RedisServer, tmp_path: Path) -> None:
    in_url = start_service("buffer", buffer_env(with_password(protected.url, PASSWORD)))
    assert await put_one(in_url.address, "job-url") == 1
    (tmp_path / "redis-password").write_text(PASSWORD + "\n")
    in_file = start_service(
        "buffer", buffer_env(protected.url, DOCKYARD_BUFFER_REDIS_PASSWORD_FILE=str(tmp_path / "redis-password"))
    )
    assert await put_one(in_file.address, "job-file") == 1
    assert PASSWORD not in in_url.logs() + in_file.logs()


def start_failing(env: dict[str, str], service: str = "buffer") -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}"],
        env={"PATH": "/usr/bin:/bin", **env, f"DOCKYARD_{service.upper()}_PORT": str(free_port())},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0, f"the {service} started"
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("wrong", ["refused the password", "redis://:***@127.0.0.1"]),
        ("missing", ["requires a password", "DOCKYARD_BUFFER_REDIS_PASSWORD"]),
        ("twice", ["one place only", "DOCKYARD_BUFFER_REDIS_URL"]),
    ],
)
def test_bad_password_stops_the_buffer_at_startup(protected: RedisServer, case: str, words: list[str]) -> None:
    wrong = "not-" + PASSWORD
    env = {
        "wrong": buffer_env(with_password(protected.url, wrong)),
        "missing": buffer_env(protected.url),
        "twice": buffer_env(with_password(protected.url, PASSWORD), DOCKYARD_BUFFER_REDIS_PASSWORD=PASSWORD),
    }[case]
    result = start_failing(env)
    for word in words:
        assert word in result.stderr, result.stderr
    assert PASSWORD not in result.stderr + result.stdout
    assert wrong not in result.stderr + result.stdout


def coordinator_env(url: str, **extra: str) -> dict[str, str]:
    return {"DOCKYARD_COORDINATOR_STATE_REDIS_URL": url, **extra}


async def test_the_coordinator_keeps_jobs_in_a_protected_redis(
    start_service, protected: RedisServer, tmp_path: Path
) -> None:
    import redis.asyncio as aioredis

    from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
    from dockyard.config import load_config

    (tmp_path / "pw").write_text(PASSWORD + "\n")
    env = coordinator_env(protected.url, DOCKYARD_COORDINATOR_STATE_REDIS_PASSWORD_FILE=str(tmp_path / "pw"))
    coordinator = start_service("coordinator", env)
    cfg = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", ["policy.model_name=null"])
    async with connect(coordinator.address, default_timeout=10) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=cfg.resolved_yaml()))).job
        await stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job.job_id))
    client = aioredis.Redis.from_url(protected.url, password=PASSWORD)
    try:
        for _ in range(50):  # the store is written in the background
            if await client.hexists("dockyard:coordinator:jobs", job.job_id):
                break
            await asyncio.sleep(0.1)
        assert await client.hexists("dockyard:coordinator:jobs", job.job_id)
    finally:
        await client.aclose()
    assert PASSWORD not in coordinator.logs()


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("wrong", ["refused the password", "redis://:***@127.0.0.1"]),
        ("missing", ["requires a password", "DOCKYARD_COORDINATOR_STATE_REDIS_PASSWORD"]),
        ("twice", ["one place only", "DOCKYARD_COORDINATOR_STATE_REDIS_URL"]),
    ],
)
def test_bad_password_stops_the_coordinator_at_startup(protected: RedisServer, case: str, words: list[str]) -> None:
    wrong = "not-" + PASSWORD
    env = {
        "wrong": coordinator_env(with_password(protected.url, wrong)),
        "missing": coordinator_env(protected.url),
        "twice": coordinator_env(
            with_password(protected.url, PASSWORD), DOCKYARD_COORDINATOR_STATE_REDIS_PASSWORD=PASSWORD
        ),
    }[case]
    result = start_failing(env, "coordinator")
    for word in words:
        assert word in result.stderr, result.stderr
    assert PASSWORD not in result.stderr + result.stdout
    assert wrong not in result.stderr + result.stdout


async def test_a_data_plane_client_without_the_password_streams_through_the_buffer_and_says_what_to_set(
    start_service, protected: RedisServer, monkeypatch
) -> None:
    buffer = start_service("buffer", buffer_env(with_password(protected.url, PASSWORD)))
    async with connect(buffer.address, default_timeout=10) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        monkeypatch.delenv(PASSWORD_VARIABLE, raising=False)
        with capture_logs() as logs:
            assert await DataPlane.discover(stub) is None
        [warning] = [entry for entry in logs if entry["event"].startswith("data plane unused")]
        assert "requires a password" in warning["error"] and PASSWORD_VARIABLE in warning["error"]
        assert PASSWORD not in str(logs)
        monkeypatch.setenv(PASSWORD_VARIABLE, PASSWORD)
        plane = await DataPlane.discover(stub)
        assert plane is not None
        await plane.close()
