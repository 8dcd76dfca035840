"""The Redis Streams buffer backend: backend.BufferBackend's semantics, kept in Redis.

Keys of one job, all under one hash tag so that they share a cluster slot
(`P` is the key prefix, `J` the job id with `%`, `{`, `}` percent-encoded):

    P:{J}:meta          hash    max_groups, max_age, latest_version, held, pending,
                                puts, duplicate_puts, acked, dropped_stale, reclaimed,
                                trainer_lease (the job's trainer lease, once taken)
    P:{J}:versions      zset    weight versions that have a stream or remembered ids
    P:{J}:held          hash    weight_version -> held groups (no field when 0)
    P:{J}:index         hash    group_id -> weight_version   (every remembered id)
    P:{J}:ids:<v>       hash    group_id -> h|<entry>|<size>, p|<entry>|<size>, a, d
    P:{J}:entries       hash    <v>/<entry> -> group_id      (held and pending only)
    P:{J}:d:<group_id>  string  the group's packed payload   (held and pending only)
    P:{J}:s:<group_id>:<nonce>
                        string  a payload a writer staged in the data plane, with an expiry,
                                until its put renames it to P:{J}:d:<group_id> or CloseJob
                                deletes it
    P:{J}:v:<v>         stream  one entry per held or pending group of version v:
                                g=group_id s=size p=metadata (serialized Group)
                                d=1 when the group has a payload, 0 for a whole Group;
                                consumer group "buffer": its PEL is the pending set

Guarantees:

- Every method is one Lua script (EVALSHA), so each put, sample, reclaim and ack
  is atomic for every client of the Redis server, across buffer processes. A
  Redis that is down, restarting or still loading answers UNAVAILABLE (safe to
  retry), never INTERNAL. A put retried after a crash, a timeout or a lost reply is answered as a
  duplicate and never stored twice (Redis 7.0 has no idempotent XADD).
- Held groups are the entries after the consumer group's last-delivered id:
  sampling reads them with XREADGROUP in ascending version, each stream in put
  order, so leases are oldest version first, ties in put order. Sizes are
  checked before the read, so nothing is leased that is not returned.
- Lease times are Redis's own PEL delivery times: they survive a restart of the
  buffer service, and of Redis itself with AOF on (see docs/buffer.md).
- Memory stays bounded: acked and dropped entries are XACKed then XDELed (no
  PEL leftovers); a stale version's stream is deleted once it holds nothing;
  ids of versions older than latest_version - max_age - 1 are forgotten once
  their version holds nothing; `entries` keeps only held and pending groups.
- A pending entry deleted behind the buffer's back (XDEL, XTRIM) is found by
  reclaim in XAUTOCLAIM's deleted-ids reply: never returned, its id marked
  dropped and counted in dropped_stale, so puts == held + pending + acked +
  dropped_stale still holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dockyard.api.common.v1 import common_pb2
from dockyard.experience.data_plane import job_base, staging_base
from dockyard.redis_url import explain_auth_failure
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.buffer.backend import (
    BufferBackend,
    BufferStats,
    StagedPayload,
    StoredGroup,
    check_advance_lease,
    check_clock,
    new_lease_id,
    not_lease_holder,
    unearned_advance,
)
from services.buffer.redis_scripts import ACK, CLOSE, PUT, RECLAIM, REWIND, SAMPLE, TAKE_LEASE

_COUNTERS = ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts", "reclaimed")


P = ParamSpec("P")
T = TypeVar("T")


def _unavailable_while_redis_is_down(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A lost connection to Redis (down, restarting, still loading its AOF) is UNAVAILABLE: callers retry,
    and every method is one atomic script, so a retry never applies anything twice."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"the buffer cannot reach its Redis ({type(exc).__name__}: {exc}); try again") from None

    return call


class RedisBuffer(BufferBackend):
    """Buffer state in Redis Streams; any number of buffer processes may share one Redis."""

    def __init__(self, url: str, *, key_prefix: str = "dockyard:buffer", password: str | None = None) -> None:
        # `password` is sent besides the URL (AUTH); a password inside the URL works as well.
        self._redis = aioredis.Redis.from_url(url, password=password)
        self._prefix = key_prefix
        self._put = self._redis.register_script(PUT)
        self._sample = self._redis.register_script(SAMPLE)
        self._reclaim = self._redis.register_script(RECLAIM)
        self._ack = self._redis.register_script(ACK)
        self._close = self._redis.register_script(CLOSE)
        self._rewind = self._redis.register_script(REWIND)
        self._take_lease = self._redis.register_script(TAKE_LEASE)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        key_prefix: str = "dockyard:buffer",
        password: str | None = None,
        password_variable: str = "DOCKYARD_BUFFER_REDIS_PASSWORD",
    ) -> RedisBuffer:
        """A backend whose Redis answered PING: a wrong URL or password fails at startup, not at the first put.

        A refused password raises RedisAuthError, whose message masks it and names `password_variable`.
        """
        backend = cls(url, key_prefix=key_prefix, password=password)
        try:
            await backend.ping()
        except AuthenticationError as exc:
            await backend.close()
            raise explain_auth_failure(url, password, password_variable, exc) from None
        except Exception:
            await backend.close()
            raise
        return backend

    async def ping(self) -> None:
        """PING the Redis; raises what redis-py raises (AuthenticationError for a refused password)."""
        await self._redis.ping()

    def job_keys_base(self, job_id: str) -> str:
        """The prefix of every key of the job, e.g. `dockyard:buffer:{job-1}:`."""
        return job_base(self._prefix, job_id)

    def data_plane_prefix(self) -> str:
        return self._prefix

    def _keys(self, job_id: str) -> tuple[list[str], str]:
        base = self.job_keys_base(job_id)
        return [base + name for name in ("meta", "versions", "held", "index", "entries")], base

    @staticmethod
    def _no_job(job_id: str) -> NotFound:
        return NotFound(f"the buffer has no job {job_id!r}; OpenJob first")

    @_unavailable_while_redis_is_down
    async def open_job(self, job_id: str, max_groups: int, max_age: int, rewind_to: int | None = None) -> None:
        keys, base = self._keys(job_id)
        await self._redis.hset(keys[0], mapping={"max_groups": max_groups, "max_age": max_age})
        if rewind_to is not None:
            await self._rewind(keys=keys, args=[base, str(rewind_to)])

    @_unavailable_while_redis_is_down
    async def close_job(self, job_id: str) -> None:
        keys, base = self._keys(job_id)
        reply = await self._close(keys=keys, args=[base])
        if reply[0] == b"nojob":
            raise self._no_job(job_id)
        # Payloads staged for puts that never came are known to no index: found by their prefix.
        pattern = _glob_escape(staging_base(self._prefix, job_id)) + "*"
        batch: list[bytes] = []
        async for key in self._redis.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                await self._redis.unlink(*batch)
                batch.clear()
        if batch:
            await self._redis.unlink(*batch)

    @_unavailable_while_redis_is_down
    async def put_group(self, group: common_pb2.Group, payload: bytes = b"") -> tuple[bool, bool]:
        keys, base = self._keys(group.job_id)
        metadata = group.SerializeToString()
        args = [base, group.group_id, str(group.weight_version), metadata, str(len(metadata) + len(payload))]
        if not payload:
            reply = await self._put(keys=keys, args=[*args, "0"])
        else:
            # One transaction: the payload (NX: a duplicate keeps the first), then the script, which
            # deletes it again unless the group is held or pending.
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(base + "d:" + group.group_id, payload, nx=True)
                await self._put(keys=keys, args=[*args, "1"], client=pipe)
                _, reply = await pipe.execute()
        return self._put_answer(group, reply)

    @_unavailable_while_redis_is_down
    async def put_staged(self, group: common_pb2.Group, staged: StagedPayload) -> tuple[bool, bool]:
        if not staged.key.startswith(staging_base(self._prefix, group.job_id)):
            raise InvalidArgument(
                f"group {group.group_id!r}: payload_key {staged.key!r} is not one of job {group.job_id!r}'s staging "
                f"keys ({staging_base(self._prefix, group.job_id)}...)"
            )
        keys, base = self._keys(group.job_id)
        metadata = group.SerializeToString()
        args = [base, group.group_id, str(group.weight_version), metadata, str(len(metadata) + staged.size)]
        reply = await self._put(keys=keys, args=[*args, "2", staged.key, str(staged.size)])
        return self._put_answer(group, reply, staged)

    def _put_answer(
        self, group: common_pb2.Group, reply: list, staged: StagedPayload | None = None
    ) -> tuple[bool, bool]:
        status = reply[0].decode()
        if status == "nojob":
            raise self._no_job(group.job_id)
        if status == "duplicate":
            return True, False
        if status == "stale":
            return False, True
        if status == "future":
            raise FailedPrecondition(
                f"group {group.group_id!r} was generated at weight version {group.weight_version}, but the trainer "
                f"of job {group.job_id!r} has reached only version {reply[1].decode()}: a version from the future"
            )
        if status == "full":
            raise ResourceExhausted(
                f"buffer full for job {group.job_id!r}: {reply[1].decode()} groups held or pending "
                f"(max_groups={reply[2].decode()}); back off and retry once the trainer has sampled and acked"
            )
        if status == "nostage" and staged:
            raise FailedPrecondition(
                f"group {group.group_id!r}: its staged payload {staged.key!r} is not in Redis (never written, or "
                "expired); stage it again"
            )
        if status == "stagesize" and staged:
            raise FailedPrecondition(
                f"group {group.group_id!r}: its staged payload {staged.key!r} is {reply[1].decode()} bytes, "
                f"not the {staged.size} the put declares"
            )
        return False, False

    async def _check_clock(
        self,
        job_id: str,
        keys: list[str],
        version: int,
        *,
        setting: bool = False,
        lease: str | None = None,
        advancing: str | None = None,
    ) -> None:
        """The trainer lease (when given), then check_clock against the stored clock; the clock only moves
        forward between here and the script, so a version allowed here is still allowed there (the ack
        script checks the lease again, atomically with the ack)."""
        max_groups, latest, holder = await self._redis.hmget(keys[0], ["max_groups", "latest_version", "trainer_lease"])
        if max_groups is None:
            raise self._no_job(job_id)
        if lease is not None and (not lease or (holder or b"").decode() != lease):
            raise not_lease_holder(job_id, lease)
        check_clock(job_id, version, int(latest or 0), setting=setting)
        # A sample or reclaim above the clock: checked here only (a lease taken over between here and
        # the script lets the old holder's call through once; its acks are refused all the same).
        check_advance_lease(job_id, version, int(latest or 0), advancing, (holder or b"").decode())

    @_unavailable_while_redis_is_down
    async def sample(
        self,
        job_id: str,
        consumer: str,
        trainer_version: int,
        max_groups: int,
        max_bytes: int,
        *,
        by_reference: bool = False,
        lease: str | None = None,
    ) -> tuple[list[StoredGroup], int]:
        keys, base = self._keys(job_id)
        await self._check_clock(job_id, keys, trainer_version, advancing=lease)
        reply = await self._sample(keys=keys, args=[base, consumer, trainer_version, max_groups, max_bytes])
        return await self._groups(job_id, reply, by_reference)

    @_unavailable_while_redis_is_down
    async def reclaim(
        self,
        job_id: str,
        consumer: str,
        trainer_version: int,
        max_groups: int,
        max_bytes: int,
        min_idle: float,
        *,
        by_reference: bool = False,
        lease: str | None = None,
    ) -> tuple[list[StoredGroup], int]:
        keys, base = self._keys(job_id)
        await self._check_clock(job_id, keys, trainer_version, advancing=lease)
        # Rounded up, so a lease is never taken over before min_idle has passed.
        min_idle_ms = max(0, math.ceil(min_idle * 1000))
        reply = await self._reclaim(
            keys=keys, args=[base, consumer, trainer_version, max_groups, max_bytes, min_idle_ms]
        )
        return await self._groups(job_id, reply, by_reference)

    async def _groups(self, job_id: str, reply: list, by_reference: bool) -> tuple[list[StoredGroup], int]:
        """The leased groups with their payloads, read by one MGET outside the script (`by_reference`: their keys)."""
        if reply[0] == b"nojob":
            raise self._no_job(job_id)
        base = self.job_keys_base(job_id)
        if by_reference:
            groups = [
                StoredGroup(g.decode(), int(v), meta, payload_key=base + "d:" + g.decode() if flag == b"1" else "")
                for g, v, meta, flag in reply[2]
            ]
            return groups, int(reply[1])
        with_payload = [g.decode() for g, _, _, flag in reply[2] if flag == b"1"]
        read = await self._redis.mget([base + "d:" + g for g in with_payload]) if with_payload else []
        payloads = dict(zip(with_payload, read, strict=True))
        groups = []
        for g, v, meta, _ in reply[2]:
            gid = g.decode()
            data = payloads.get(gid, b"")
            if data is None:
                # Only a concurrent ack, reclaim, rewind or close frees a leased group's payload.
                raise Unavailable(
                    f"the payload of group {gid!r} of job {job_id!r} was freed while it was leased; try again"
                )
            groups.append(StoredGroup(gid, int(v), meta, data))
        return groups, int(reply[1])

    @_unavailable_while_redis_is_down
    async def take_lease(self, job_id: str, consumer: str) -> str:
        keys, _ = self._keys(job_id)
        lease = new_lease_id(consumer)
        # One script: the job is known and the lease set atomically (never a lease of a closed job).
        if not await self._take_lease(keys=keys[:1], args=[lease]):
            raise self._no_job(job_id)
        return lease

    @_unavailable_while_redis_is_down
    async def ack(self, job_id: str, group_ids: Sequence[str], weight_version: int, lease: str | None = None) -> int:
        keys, base = self._keys(job_id)
        await self._check_clock(job_id, keys, weight_version, setting=not group_ids, lease=lease)
        checked = ["0", ""] if lease is None else ["1", lease]
        reply = await self._ack(keys=keys, args=[base, weight_version, *checked, *group_ids])
        status = reply[0].decode()
        if status == "nojob":
            raise self._no_job(job_id)
        if status == "lease":
            raise not_lease_holder(job_id, lease or "")
        if status == "notfound":
            raise NotFound(f"group {reply[1].decode()!r} was never put for job {job_id!r} (or is long forgotten)")
        if status == "held":
            raise FailedPrecondition(
                f"group {reply[1].decode()!r} of job {job_id!r} is held but was never sampled; "
                f"only leased groups can be acked"
            )
        if status == "dropped":
            raise FailedPrecondition(f"group {reply[1].decode()!r} of job {job_id!r} aged out; it cannot be acked")
        if status == "unearned":
            raise unearned_advance(job_id, weight_version, int(reply[1]))
        return int(reply[1])

    @_unavailable_while_redis_is_down
    async def stats(self, job_id: str) -> BufferStats:
        keys, _ = self._keys(job_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.hgetall(keys[2])
            meta, held = await pipe.execute()
        if not meta:
            raise self._no_job(job_id)
        meta = {k.decode(): int(v) for k, v in meta.items() if k != b"trainer_lease"}  # the rest are numbers
        return BufferStats(
            **{name: meta.get(name, 0) for name in _COUNTERS},
            latest_version=meta.get("latest_version", 0),
            max_groups=meta["max_groups"],
            max_age=meta["max_age"],
            held_versions={int(v): int(n) for v, n in held.items() if int(n) > 0},
        )

    async def close(self) -> None:
        await self._redis.aclose()


def _glob_escape(text: str) -> str:
    """`text` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
