"""Generate with a staging destination, on a real rollout process and a real redis-server: the group's
payload lands in the buffer's data plane byte for byte as the coordinator would have packed it, and the
reply carries no token arrays; where staging cannot be done, the reply carries the arrays as before."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import grpc
import redis

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.experience import payload, single_turn
from dockyard.experience.data_plane import redis_host, staging_base
from dockyard.rpc.client import connect
from tests.conftest import RedisServer, expect_code, redis_binary
from tests.contract.test_rollout_service import CONFIG_YAML, ENV, JOB, sampling

PREFIX = "dockyard:buffer"
PASSWORD = "pw-Rollout-5e1d"
GROUP = f"{JOB}/s1/g0"


def plane(url: str, **limits) -> buffer_pb2.GetDataPlaneResponse:
    fields = dict(key_prefix=PREFIX, staging_ttl_seconds=60, max_trajectory_tokens=4096, max_group_bytes=16 << 20)
    return buffer_pb2.GetDataPlaneResponse(redis_url=url, **(fields | limits))


def request(staging: rollout_pb2.PayloadStaging | None = None) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        job_id=JOB,
        prompt="1+2=",
        num_samples=3,
        sampling=sampling(seed=7, max_new_tokens=12, ignore_eos=True),
        staging=staging,
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_stages_the_payload_in_the_data_plane(start_service, redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    rollout = start_service("rollout", ENV)
    asyncio.run(_staging(rollout.address, redis_server, client))
    logs = rollout.logs()
    assert "payload not staged: it fails the buffer's checks" in logs, logs[-3000:]
    assert "data plane unused" in logs, logs[-3000:]
    assert rollout.stop() == 0, logs[-3000:]


async def _staging(address: str, url: str, client: redis.Redis) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
        plain = await stub.Generate(request())
        assert not plain.payload_key and plain.payload_bytes == 0
        assert [c.num_tokens for c in plain.completions] == [12, 12, 12]

        # Staged: the reply has texts, finish reasons and counts, no arrays; the key holds the payload.
        staged = await stub.Generate(request(rollout_pb2.PayloadStaging(data_plane=plane(url), group_id=GROUP)))
        assert staged.payload_key.startswith(f"{staging_base(PREFIX, JOB)}{GROUP}:")
        assert not staged.prompt_token_ids
        assert all(not c.token_ids and not c.logprobs for c in staged.completions)
        assert [c.num_tokens for c in staged.completions] == [12, 12, 12]
        assert [(c.text, c.finish_reason) for c in staged.completions] == [
            (c.text, c.finish_reason) for c in plain.completions
        ]
        stored = client.get(staged.payload_key)
        whole = common_pb2.Group(
            group_id=GROUP,
            trajectories=single_turn.token_trajectories(GROUP, plain.prompt_token_ids, plain.completions),
        )
        assert stored == payload.split(whole)[1]  # as the coordinator packs the same arrays
        assert staged.payload_bytes == len(stored)
        assert 0 < client.ttl(staged.payload_key) <= 60  # staged, not kept: a PutGroup takes it over

        # A payload the buffer's limits refuse is not staged: the arrays come back as without staging.
        strict = rollout_pb2.PayloadStaging(data_plane=plane(url, max_trajectory_tokens=5), group_id=GROUP)
        refused = await stub.Generate(request(strict))
        assert not refused.payload_key and list(refused.completions) == list(plain.completions)

        # A data plane the replica cannot reach: the same, nothing lost.
        away = rollout_pb2.PayloadStaging(data_plane=plane(f"redis://127.0.0.1:{closed_port()}/0"), group_id=GROUP)
        unreached = await stub.Generate(request(away))
        assert not unreached.payload_key and list(unreached.completions) == list(plain.completions)
        assert list(unreached.prompt_token_ids) == list(plain.prompt_token_ids)
        assert len(client.keys("*")) == 1  # only the one staged payload

        # Bad staging fields are refused by name; GenerateStream refuses staging altogether.
        for staging, word in [
            (rollout_pb2.PayloadStaging(data_plane=plane(url)), "staging.group_id"),
            (rollout_pb2.PayloadStaging(data_plane=plane(""), group_id=GROUP), "staging.data_plane.redis_url"),
            (rollout_pb2.PayloadStaging(data_plane=plane(url, key_prefix=""), group_id=GROUP), "key_prefix"),
        ]:
            await expect_code(stub.Generate(request(staging)), grpc.StatusCode.INVALID_ARGUMENT, word)
        stream = stub.GenerateStream(
            rollout_pb2.GenerateStreamRequest(request=request(rollout_pb2.PayloadStaging(group_id=GROUP)))
        )
        await expect_code(_drain(stream), grpc.StatusCode.INVALID_ARGUMENT, "staging")


async def _drain(call) -> None:
    async for _ in call:
        pass


def test_the_replica_logs_in_to_a_protected_data_plane_with_its_own_password(start_service, tmp_path) -> None:
    server = RedisServer(redis_binary(), tmp_path / "redis-auth", password=PASSWORD)
    (tmp_path / "redis-auth").mkdir()
    server.start()
    try:
        (tmp_path / "pw").write_text(PASSWORD + "\n")
        login = {"DOCKYARD_DATA_PLANE_REDIS_PASSWORD_FILE": str(tmp_path / "pw")}
        with_file = start_service("rollout", ENV | login | {"DOCKYARD_DATA_PLANE_REDIS_HOSTS": redis_host(server.url)})
        without = start_service("rollout", ENV)
        staged, unstaged = asyncio.run(_protected([with_file.address, without.address], server.url))
        assert staged.payload_key and not staged.prompt_token_ids
        assert not unstaged.payload_key and unstaged.prompt_token_ids  # could not log in: the arrays come back
        client = redis.Redis.from_url(server.url, password=PASSWORD)
        assert client.strlen(staged.payload_key) == staged.payload_bytes
        # The password went nowhere but to Redis: never in a log line, and the missing one is named.
        assert PASSWORD not in with_file.logs() + without.logs()
        assert "DOCKYARD_DATA_PLANE_REDIS_PASSWORD" in without.logs(), without.logs()[-3000:]
    finally:
        server.stop()


def test_the_password_goes_only_to_a_data_plane_the_replica_allows(start_service, tmp_path) -> None:
    """A caller naming its own Redis gets the arrays back, and that Redis never sees the password: not when
    it is off the replica's list, nor when the replica has a password and no list at all."""
    heard, listener = bytearray(), socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_record, args=(listener, heard), daemon=True).start()
    decoy = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    login = ENV | {"DOCKYARD_DATA_PLANE_REDIS_PASSWORD_FILE": str(tmp_path / "pw")}
    listed = start_service("rollout", login | {"DOCKYARD_DATA_PLANE_REDIS_HOSTS": "redis:6379, 10.0.0.7:6380"})
    unlisted = start_service("rollout", login)
    replies = asyncio.run(_protected([listed.address, unlisted.address], decoy))
    assert all(not r.payload_key and r.prompt_token_ids for r in replies)  # nothing lost: the arrays come back
    assert not heard, bytes(heard)  # no connection was even made
    assert f"127.0.0.1:{listener.getsockname()[1]} is not in DOCKYARD_DATA_PLANE_REDIS_HOSTS" in listed.logs()
    assert "DOCKYARD_DATA_PLANE_REDIS_HOSTS must name" in unlisted.logs(), unlisted.logs()[-3000:]
    listener.close()


def _record(listener: socket.socket, heard: bytearray) -> None:
    with contextlib.suppress(OSError):
        while True:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    while data := conn.recv(4096):
                        heard.extend(data)


async def _protected(addresses: list[str], url: str) -> tuple[rollout_pb2.GenerateResponse, ...]:
    replies = []
    for where in addresses:
        async with connect(where, default_timeout=120) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
            staging = rollout_pb2.PayloadStaging(data_plane=plane(url), group_id=GROUP)
            replies.append(await stub.Generate(request(staging)))
    return tuple(replies)
