"""The experience data plane: payloads go from their writer to Redis and from Redis to the trainer,
around every gRPC hop; only metadata crosses the buffer service.

    writer  ─check_payload─> SET <prefix>:{job}:s:<group>:<nonce> payload EX ttl ───────────> redis
            └─PutGroup(metadata, payload_key, payload_bytes)─> buffer ─Lua: RENAME staged key─┘ to the group's
    trainer ─SampleGroupsStream(payload_by_reference)─> buffer: metadata + each group's payload key
            └─MGET keys─> redis: the payloads, byte for byte as the writer packed them
    The payload's writer may not be the put's: a rollout replica stages a single-turn group's payload
    (single_turn.py) and the coordinator puts its metadata with that key.

The buffer advertises its data plane (GetDataPlane): its Redis URL, never with a password, and the
key prefix. A client sends the password it reads from DOCKYARD_DATA_PLANE_REDIS_PASSWORD (or
DOCKYARD_DATA_PLANE_REDIS_PASSWORD_FILE). A buffer in memory, one with its data plane off, one
older than GetDataPlane, or a Redis this client cannot reach or log in to gives no data plane:
`discover` (and `connect_named`, for a writer told of the data plane by another: the rollout) returns
None (the last two with a warning) and the caller streams payloads through the buffer service
instead (PutGroupStream, SampleGroupsStream; a rollout replica returns the arrays to its caller),
with the same semantics.

Guarantees: a payload is checked (dockyard.experience.checks, and the buffer's size limit) before
it is staged, so the buffer, which never reads staged bytes, holds only payloads the trainer can
train on; a staged key lives `staging_ttl_seconds` unless the buffer takes it over, so a writer
that dies between its SET and its put leaves nothing behind for long; staged keys are unique per
put attempt and lie in the job's Redis Cluster slot; `read` returns every payload asked for or
raises PayloadGone. A data plane an RPC names is connected to only where DOCKYARD_DATA_PLANE_REDIS_HOSTS
lists it, or, with that unset, while no password is set: no caller can draw the password elsewhere.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from urllib.parse import urlsplit

import grpc
import redis.asyncio as aioredis
import structlog
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import AuthenticationError, RedisError

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.experience.checks import check_payload
from dockyard.redis_url import RedisConfigError, explain_auth_failure, mask_url, read_password
from dockyard.rpc.errors import InvalidArgument

log = structlog.get_logger()

PASSWORD_VARIABLE = "DOCKYARD_DATA_PLANE_REDIS_PASSWORD"
SOCKET_TIMEOUT_S = 60.0  # far above a 16 MiB group's transfer, even over a slow link


class DataPlaneSettings(BaseSettings):
    """DOCKYARD_DATA_PLANE_*: how a client (coordinator, rollout, trainer) logs in to the data plane's Redis."""

    model_config = SettingsConfigDict(env_prefix="DOCKYARD_DATA_PLANE_", extra="ignore", hide_input_in_errors=True)

    redis_password: str = Field("", repr=False, description="Password of the data plane's Redis.")
    redis_password_file: str = Field("", description="File holding that password (a mounted secret).")
    redis_hosts: str = Field(
        "",
        description="Comma-separated host:port a data plane named to this service by an RPC may be (the rollout's "
        "Generate); empty: any, but only while no password is set.",
    )


class PayloadGone(RuntimeError):
    """A leased group's payload is no longer in Redis: its lease ended (acked, reclaimed, dropped, job closed)."""


def redis_host(url: str) -> str:
    """`host:port` of a Redis URL, lower case, the port 6379 when it names none (what the allow-list holds)."""
    parts = urlsplit(url)
    try:
        port = parts.port or 6379
    except ValueError:
        return "<unparsable redis url>"
    return f"{(parts.hostname or '').lower()}:{port}"


def job_tag(job_id: str) -> str:
    """The job id as a Redis Cluster hash tag: `}` would end the tag early; `%` is escaped so decoding stays
    unambiguous."""
    return job_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def job_base(key_prefix: str, job_id: str) -> str:
    """The prefix of every key of the job, e.g. `dockyard:buffer:{job-1}:`."""
    return f"{key_prefix}:{{{job_tag(job_id)}}}:"


def staging_base(key_prefix: str, job_id: str) -> str:
    """The prefix of the job's staged payload keys; the buffer takes over only keys under it."""
    return job_base(key_prefix, job_id) + "s:"


class DataPlane:
    """One client's connection to the buffer's Redis, for staging payloads and reading leased ones."""

    def __init__(self, client: aioredis.Redis, limits: buffer_pb2.GetDataPlaneResponse) -> None:
        self._redis = client
        self.advertised = limits  # the GetDataPlane answer it was made from, to name it to another writer
        self._prefix = limits.key_prefix
        self.ttl = limits.staging_ttl_seconds or 600
        self._scripts: dict[str, object] = {}
        self._max_tokens = limits.max_trajectory_tokens
        self.max_group_bytes = limits.max_group_bytes

    @classmethod
    async def discover(cls, stub: buffer_pb2_grpc.BufferServiceStub) -> DataPlane | None:
        """The buffer's data plane, connected and answering PING; None where there is none to use."""
        try:
            reply = await stub.GetDataPlane(buffer_pb2.GetDataPlaneRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return None  # a buffer older than the data plane
        if not reply.redis_url:
            return None
        return await cls.connect(reply)

    @classmethod
    async def connect_named(cls, reply: buffer_pb2.GetDataPlaneResponse) -> DataPlane | None:
        """`connect`, for a data plane an RPC named (not one this client discovered at its own buffer): only
        to a Redis in DOCKYARD_DATA_PLANE_REDIS_HOSTS, or, with that unset, only while no password is set, so
        a caller cannot draw the password to a Redis of its choosing. None (with a warning) otherwise."""
        settings = DataPlaneSettings()
        allowed = {h.strip().lower() for h in settings.redis_hosts.split(",") if h.strip()}
        where = redis_host(reply.redis_url)
        if allowed and where not in allowed:
            reason = f"{where} is not in DOCKYARD_DATA_PLANE_REDIS_HOSTS"
        elif not allowed and (settings.redis_password or settings.redis_password_file):
            reason = "with a password set, DOCKYARD_DATA_PLANE_REDIS_HOSTS must name the data plane's host:port"
        else:
            return await cls.connect(reply)
        log.warning("data plane named by a caller unused: " + reason, redis=mask_url(reply.redis_url))
        return None

    @classmethod
    async def connect(cls, reply: buffer_pb2.GetDataPlaneResponse) -> DataPlane | None:
        """A connection to the data plane `reply` advertises, answering PING; None (with a warning) where its
        password setting is unusable or its Redis does not answer this client."""
        settings = DataPlaneSettings()
        try:
            password = read_password(
                reply.redis_url, settings.redis_password, settings.redis_password_file, PASSWORD_VARIABLE
            )
        except RedisConfigError as exc:
            log.warning("data plane unused: its password setting is unusable", reason=str(exc))
            return None
        # Bounded waits: a Redis that stops answering fails a put or a lease (retried), never hangs it.
        client = aioredis.Redis.from_url(
            reply.redis_url, password=password, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10
        )
        try:
            await client.ping()
        except (RedisError, OSError) as exc:
            await client.aclose()
            if isinstance(exc, AuthenticationError):
                error = str(explain_auth_failure(reply.redis_url, password, PASSWORD_VARIABLE, exc))
            else:
                error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "data plane unused: its Redis does not answer this client, payloads go through the buffer service",
                redis=mask_url(reply.redis_url),
                error=error,
            )
            return None
        return cls(client, reply)

    async def stage(self, metadata: common_pb2.Group, payload: bytes) -> str:
        """Check `payload` against `metadata` with the buffer's limits (InvalidArgument naming what is wrong),
        SET it under a fresh staging key of the group's job, with the staging expiry; the key."""
        size = metadata.ByteSize() + len(payload)
        if self.max_group_bytes and size > self.max_group_bytes:
            raise InvalidArgument(
                f"group {metadata.group_id!r} is {size / 2**20:.1f} MiB; the buffer's limit is "
                f"{self.max_group_bytes / 2**20:.1f} MiB (DOCKYARD_BUFFER_MAX_GROUP_MB)"
            )
        check_payload(metadata, payload, self._max_tokens)
        key = self.staging_key(metadata.job_id, metadata.group_id)
        await self._redis.set(key, payload, ex=self.ttl)
        return key

    def staging_key(self, job_id: str, name: str) -> str:
        """A fresh staging key of the job for `name` (a group or trajectory id): unique per call."""
        return f"{staging_base(self._prefix, job_id)}{name}:{uuid.uuid4().hex}"

    async def run_script(self, script: str, keys: Sequence[str], args: Sequence[str | int]):
        """A Lua script over keys of one job (one cluster slot), by EVALSHA (loaded again after a restart)."""
        if script not in self._scripts:
            self._scripts[script] = self._redis.register_script(script)
        return await self._scripts[script](keys=list(keys), args=list(args))

    async def renew(self, key: str) -> bool:
        """Restart a staged key's expiry before a put is retried; False if it is gone (expired: stage again)."""
        return bool(await self._redis.expire(key, self.ttl))

    async def discard(self, key: str) -> None:
        """Delete a staged key whose put will not come (the writer dropped its group); gone already is fine."""
        await self._redis.delete(key)

    async def read(self, keys: Sequence[str]) -> list[bytes]:
        """The payloads under `keys`, in order, by one MGET; PayloadGone if any is missing."""
        if not keys:
            return []
        values = await self._redis.mget(list(keys))
        for key, value in zip(keys, values, strict=True):
            if value is None:
                raise PayloadGone(f"the payload {key!r} is gone: its lease ended before it was read")
        return values

    async def close(self) -> None:
        await self._redis.aclose()


class Planes:
    """The data planes one writer was told of (by a Generate, by a session's opening), connected once each.

    Guarantees: one connection per advertised data plane, kept until `close`, and only to one the writer
    allows (`DataPlane.connect_named`); one that could not be reached is not tried again for RETRY_AFTER_S,
    so an unreachable Redis delays at most one call in that time (the caller then hands its arrays back
    instead)."""

    RETRY_AFTER_S = 30.0

    def __init__(self) -> None:
        self._planes: dict[bytes, DataPlane] = {}  # by the serialized GetDataPlane answer
        self._unreachable_until: dict[bytes, float] = {}

    async def get(self, advertised: buffer_pb2.GetDataPlaneResponse) -> DataPlane | None:
        which = advertised.SerializeToString(deterministic=True)
        if (plane := self._planes.get(which)) is not None:
            return plane
        if time.monotonic() < self._unreachable_until.get(which, 0.0):
            return None
        plane = await DataPlane.connect_named(advertised)
        if plane is None:
            self._unreachable_until[which] = time.monotonic() + self.RETRY_AFTER_S
            return None
        if (raced := self._planes.get(which)) is not None:  # another call connected while this one waited
            await plane.close()
            return raced
        self._planes[which] = plane
        return plane

    async def close(self) -> None:
        planes, self._planes = list(self._planes.values()), {}
        for plane in planes:
            await plane.close()
