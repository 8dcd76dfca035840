"""The Redis Streams buffer backend: backend.BufferBackend's semantics, kept in Redis.

Keys of one job, all under one hash tag so that they share a cluster slot
(`P` is the key prefix, `J` the job id with `%`, `{`, `}` percent-encoded):

    P:{J}:meta          hash    max_groups, max_age, latest_version, held, pending,
                                puts, duplicate_puts, acked, dropped_stale, reclaimed
    P:{J}:versions      zset    weight versions that have a stream or remembered ids
    P:{J}:held          hash    weight_version -> held groups (no field when 0)
    P:{J}:index         hash    group_id -> weight_version   (every remembered id)
    P:{J}:ids:<v>       hash    group_id -> h|<entry>|<size>, p|<entry>|<size>, a, d
    P:{J}:entries       hash    <v>/<entry> -> group_id      (held and pending only)
    P:{J}:v:<v>         stream  one entry per held or pending group of version v:
                                g=group_id s=size p=serialized Group;
                                consumer group "buffer": its PEL is the pending set

Guarantees:

- Every method is one Lua script (EVALSHA), so each put, sample, reclaim and ack
  is atomic for every client of the Redis server, across buffer processes. A
  put retried after a crash, a timeout or a lost reply is answered as a
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

import math
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError

from dockyard.api.common.v1 import common_pb2
from dockyard.redis_url import explain_auth_failure
from dockyard.rpc.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.buffer.backend import BufferBackend, BufferStats

_COMMON = r"""
local META, VERSIONS, HELD, INDEX, ENTRIES = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local BASE = ARGV[1]
local GROUP = 'buffer'

-- Lua 5.1 prints large numbers as 1e+15; versions must stay exact decimal strings.
local function fmt(n) return string.format('%d', n) end
local function stream_key(v) return BASE .. 'v:' .. v end
local function ids_key(v) return BASE .. 'ids:' .. v end
local function meta_num(field) return tonumber(redis.call('HGET', META, field)) or 0 end
local function incr(field, by) if by ~= 0 then redis.call('HINCRBY', META, field, by) end end
local function fields(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end

local function held_of(v) return tonumber(redis.call('HGET', HELD, v)) or 0 end
local function add_held(v, by)
  if redis.call('HINCRBY', HELD, v, by) <= 0 then redis.call('HDEL', HELD, v) end
  incr('held', by)
end

local function pending_of(v)
  local key = stream_key(v)
  if redis.call('EXISTS', key) == 0 then return 0 end
  return redis.call('XPENDING', key, GROUP)[1]
end

-- A stale version's stream is useless once it holds nothing; its ids stay
-- (advance forgets them), so deleting it early changes nothing observable.
local function free_stale_stream(v)
  if held_of(v) == 0 and pending_of(v) == 0 then redis.call('DEL', stream_key(v)) end
end

local function last_delivered(key)
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local f = fields(info)
    if f['name'] == GROUP then return f['last-delivered-id'] end
  end
  return '0-0'
end

local function forget_ids(v)
  local names = redis.call('HKEYS', ids_key(v))
  for i = 1, #names, 1000 do
    redis.call('HDEL', INDEX, unpack(names, i, math.min(i + 999, #names)))
  end
  redis.call('DEL', ids_key(v))
end

-- Moves the clock forward and frees what can no longer be fresh: the stream
-- of a stale version once it holds nothing, and the ids of versions below the
-- horizon once they hold nothing (a late retry of such a put is stale anyway).
local function advance(to)
  local latest = meta_num('latest_version')
  if to > latest then
    latest = to
    redis.call('HSET', META, 'latest_version', fmt(to))
  end
  local max_age = meta_num('max_age')
  local horizon = latest - max_age - 1
  for _, v in ipairs(redis.call('ZRANGEBYSCORE', VERSIONS, '-inf', '(' .. fmt(latest - max_age))) do
    if held_of(v) == 0 and pending_of(v) == 0 then
      redis.call('DEL', stream_key(v))  -- with its consumer group
      if tonumber(v) < horizon then
        forget_ids(v)
        redis.call('ZREM', VERSIONS, v)
      end
    end
  end
  return latest, max_age
end

-- A pending group that leaves without an ack: aged out, or deleted behind our back.
local function drop_pending(v, entry)
  local gid = redis.call('HGET', ENTRIES, v .. '/' .. entry)
  if gid then redis.call('HSET', ids_key(v), gid, 'd') end
  redis.call('HDEL', ENTRIES, v .. '/' .. entry)
  incr('pending', -1)
  incr('dropped_stale', 1)
end

if redis.call('EXISTS', META) == 0 then return {'nojob'} end
"""

_PUT = (
    _COMMON
    + r"""
local gid, v, payload, size = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('HEXISTS', INDEX, gid) == 1 then
  incr('duplicate_puts', 1)
  return {'duplicate'}
end
local version = tonumber(v)
local latest, max_age = meta_num('latest_version'), meta_num('max_age')
if version > latest then return {'future', fmt(latest)} end
if latest - version > max_age then
  redis.call('HSET', ids_key(v), gid, 'd')
  redis.call('HSET', INDEX, gid, v)
  redis.call('ZADD', VERSIONS, version, v)
  incr('puts', 1)
  incr('dropped_stale', 1)
  return {'stale'}
end
local in_flight, max_groups = meta_num('held') + meta_num('pending'), meta_num('max_groups')
if in_flight >= max_groups then return {'full', fmt(in_flight), fmt(max_groups)} end
local key = stream_key(v)
if redis.call('EXISTS', key) == 0 then
  local created = redis.pcall('XGROUP', 'CREATE', key, GROUP, '0', 'MKSTREAM')
  if type(created) == 'table' and created.err and not string.find(created.err, 'BUSYGROUP') then
    return redis.error_reply(created.err)
  end
end
local entry = redis.call('XADD', key, '*', 'g', gid, 's', size, 'p', payload)
-- The largest group ever put lets sample skip its size peek when a whole read must fit.
if tonumber(size) > meta_num('max_size') then redis.call('HSET', META, 'max_size', size) end
redis.call('HSET', ids_key(v), gid, 'h|' .. entry .. '|' .. size)
redis.call('HSET', INDEX, gid, v)
redis.call('HSET', ENTRIES, v .. '/' .. entry, gid)
redis.call('ZADD', VERSIONS, version, v)
add_held(v, 1)
incr('puts', 1)
return {'held'}
"""
)

_SAMPLE = (
    _COMMON
    + r"""
local consumer = ARGV[2]
local latest, max_age = advance(tonumber(ARGV[3]))
local max_groups, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local oldest_fresh = latest - max_age

local dropped = 0
for _, v in ipairs(redis.call('ZRANGEBYSCORE', VERSIONS, '-inf', '(' .. fmt(oldest_fresh))) do
  if held_of(v) > 0 then
    local key = stream_key(v)
    local n = 0
    -- Undelivered entries have no PEL entry, so XDEL leaves nothing behind.
    for _, e in ipairs(redis.call('XRANGE', key, '(' .. last_delivered(key), '+')) do
      redis.call('XDEL', key, e[1])
      redis.call('HSET', ids_key(v), fields(e[2])['g'], 'd')
      redis.call('HDEL', ENTRIES, v .. '/' .. e[1])
      n = n + 1
    end
    add_held(v, -n)
    free_stale_stream(v)
    dropped = dropped + n
  end
end
incr('dropped_stale', dropped)

local out, bytes, full = {}, 0, false
for _, v in ipairs(redis.call('ZRANGEBYSCORE', VERSIONS, fmt(oldest_fresh), '+inf')) do
  if full or #out >= max_groups then break end
  if held_of(v) > 0 then
    local key = stream_key(v)
    local n, peeked = 0, false
    if bytes + (max_groups - #out) * meta_num('max_size') <= max_bytes then
      -- Even groups of the largest size seen would fit: read without peeking.
      n = max_groups - #out
    else
      -- Peek at the sizes first: XREADGROUP cannot stop at a byte limit, and an
      -- entry read but not returned would be leased to nobody.
      peeked = true
      for _, e in ipairs(redis.call('XRANGE', key, '(' .. last_delivered(key), '+', 'COUNT', max_groups - #out)) do
        local size = tonumber(fields(e[2])['s'])
        if #out + n > 0 and bytes + size > max_bytes then
          full = true
          break
        end
        bytes = bytes + size
        n = n + 1
      end
    end
    if n > 0 then
      local read = redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', n, 'STREAMS', key, '>')
      local got, read_bytes = 0, 0
      for _, e in ipairs(read and read[1][2] or {}) do
        local f = fields(e[2])
        redis.call('HSET', ids_key(v), f['g'], 'p|' .. e[1] .. '|' .. f['s'])
        out[#out + 1] = f['p']
        got, read_bytes = got + 1, read_bytes + tonumber(f['s'])
      end
      if not peeked then bytes = bytes + read_bytes end
      add_held(v, -got)
      incr('pending', got)
    end
  end
end
return {'ok', dropped, out}
"""
)

_RECLAIM = (
    _COMMON
    + r"""
local consumer = ARGV[2]
local latest, max_age = advance(tonumber(ARGV[3]))
local max_groups, max_bytes, min_idle = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local oldest_fresh = latest - max_age

local function id_less(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  if ams ~= bms then return tonumber(ams) < tonumber(bms) end
  return tonumber(aseq) < tonumber(bseq)
end

-- XAUTOCLAIM walks one stream in entry order; leases are taken oldest first
-- across all versions, so list them with their idle times and claim each one.
local leases = {}
for _, v in ipairs(redis.call('ZRANGE', VERSIONS, 0, -1)) do
  local n = pending_of(v)
  if n > 0 then
    for _, p in ipairs(redis.call('XPENDING', stream_key(v), GROUP, 'IDLE', min_idle, '-', '+', n)) do
      leases[#leases + 1] = {v = v, version = tonumber(v), id = p[1], idle = p[3]}
    end
  end
end
table.sort(leases, function(a, b)
  if a.idle ~= b.idle then return a.idle > b.idle end
  if a.version ~= b.version then return a.version < b.version end
  return id_less(a.id, b.id)
end)

local out, bytes, dropped, reclaimed, full = {}, 0, 0, 0, false
for _, lease in ipairs(leases) do
  local key = stream_key(lease.v)
  if lease.version < oldest_fresh then
    -- XACK before XDEL: an XDEL alone would leave the PEL entry behind.
    redis.call('XACK', key, GROUP, lease.id)
    redis.call('XDEL', key, lease.id)
    drop_pending(lease.v, lease.id)
    free_stale_stream(lease.v)
    dropped = dropped + 1
  elseif not full then
    local gid = redis.call('HGET', ENTRIES, lease.v .. '/' .. lease.id)
    local state = gid and redis.call('HGET', ids_key(lease.v), gid) or ''
    local size = tonumber(string.match(state, '|(%d+)$')) or 0
    if #out >= max_groups or (#out > 0 and bytes + size > max_bytes) then
      full = true
    else
      -- Starting at the lease's own id with COUNT 1, XAUTOCLAIM either claims
      -- exactly it (it is idle enough: listed above, in this same script) or
      -- reports it among the deleted ids, removing it from the PEL.
      local reply = redis.call('XAUTOCLAIM', key, GROUP, consumer, min_idle, lease.id, 'COUNT', 1)
      local claimed, deleted = reply[2], reply[3] or {}
      if claimed[1] and claimed[1][1] == lease.id then
        out[#out + 1] = fields(claimed[1][2])['p']
        bytes = bytes + size
        reclaimed = reclaimed + 1
      else
        local was_deleted = false
        for _, id in ipairs(deleted) do
          if id == lease.id then was_deleted = true end
        end
        if not was_deleted then
          return redis.error_reply('XAUTOCLAIM neither claimed nor reported entry ' .. lease.id .. ' of ' .. key)
        end
        drop_pending(lease.v, lease.id)
        dropped = dropped + 1
      end
    end
  end
end
incr('reclaimed', reclaimed)
return {'ok', dropped, out}
"""
)

_ACK = (
    _COMMON
    + r"""
local function state_of(gid)
  local v = redis.call('HGET', INDEX, gid)
  if not v then return nil end
  return v, redis.call('HGET', ids_key(v), gid)
end

-- Check every id before changing anything, so a refused ack leaves no trace.
for i = 3, #ARGV do
  local v, state = state_of(ARGV[i])
  if not state then return {'notfound', ARGV[i]} end
  local kind = string.sub(state, 1, 1)
  if kind == 'h' then return {'held', ARGV[i]} end
  if kind == 'd' then return {'dropped', ARGV[i]} end
end
local acked = 0
for i = 3, #ARGV do
  local gid = ARGV[i]
  local v, state = state_of(gid)
  local entry = string.match(state, '^p|([^|]+)|')
  if entry then
    local key = stream_key(v)
    redis.call('XACK', key, GROUP, entry)
    redis.call('XDEL', key, entry)
    redis.call('HSET', ids_key(v), gid, 'a')
    redis.call('HDEL', ENTRIES, v .. '/' .. entry)
    acked = acked + 1
  end
end
incr('pending', -acked)
incr('acked', acked)
advance(tonumber(ARGV[2]))
return {'ok', acked}
"""
)

_CLOSE = (
    _COMMON
    + r"""
for _, v in ipairs(redis.call('ZRANGE', VERSIONS, 0, -1)) do
  redis.call('DEL', stream_key(v), ids_key(v))
end
redis.call('DEL', META, VERSIONS, HELD, INDEX, ENTRIES)
return {'ok'}
"""
)

_COUNTERS = ("held", "pending", "acked", "dropped_stale", "puts", "duplicate_puts", "reclaimed")


def _tag(job_id: str) -> str:
    # A `}` inside the hash tag would end it early; `%` is escaped so decoding stays unambiguous.
    return job_id.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


class RedisBuffer(BufferBackend):
    """Buffer state in Redis Streams; any number of buffer processes may share one Redis."""

    def __init__(self, url: str, *, key_prefix: str = "dockyard:buffer", password: str | None = None) -> None:
        # `password` is sent besides the URL (AUTH); a password inside the URL works as well.
        self._redis = aioredis.Redis.from_url(url, password=password)
        self._prefix = key_prefix
        self._put = self._redis.register_script(_PUT)
        self._sample = self._redis.register_script(_SAMPLE)
        self._reclaim = self._redis.register_script(_RECLAIM)
        self._ack = self._redis.register_script(_ACK)
        self._close = self._redis.register_script(_CLOSE)

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
            await backend._redis.ping()
        except AuthenticationError as exc:
            await backend.close()
            raise explain_auth_failure(url, password, password_variable, exc) from None
        except Exception:
            await backend.close()
            raise
        return backend

    def job_keys_base(self, job_id: str) -> str:
        """The prefix of every key of the job, e.g. `dockyard:buffer:{job-1}:`."""
        return f"{self._prefix}:{{{_tag(job_id)}}}:"

    def _keys(self, job_id: str) -> tuple[list[str], str]:
        base = self.job_keys_base(job_id)
        return [base + name for name in ("meta", "versions", "held", "index", "entries")], base

    @staticmethod
    def _no_job(job_id: str) -> NotFound:
        return NotFound(f"the buffer has no job {job_id!r}; OpenJob first")

    async def open_job(self, job_id: str, max_groups: int, max_age: int, rewind_to: int | None = None) -> None:
        keys, _ = self._keys(job_id)
        settings = {"max_groups": max_groups, "max_age": max_age}
        if rewind_to is not None:
            settings["latest_version"] = rewind_to
        await self._redis.hset(keys[0], mapping=settings)

    async def close_job(self, job_id: str) -> None:
        keys, base = self._keys(job_id)
        reply = await self._close(keys=keys, args=[base])
        if reply[0] == b"nojob":
            raise self._no_job(job_id)

    async def put_group(self, group: common_pb2.Group) -> tuple[bool, bool]:
        keys, base = self._keys(group.job_id)
        payload = group.SerializeToString()
        reply = await self._put(
            keys=keys, args=[base, group.group_id, str(group.weight_version), payload, str(len(payload))]
        )
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
        return False, False

    async def sample(
        self, job_id: str, consumer: str, trainer_version: int, max_groups: int, max_bytes: int
    ) -> tuple[list[common_pb2.Group], int]:
        keys, base = self._keys(job_id)
        reply = await self._sample(keys=keys, args=[base, consumer, trainer_version, max_groups, max_bytes])
        return self._groups(job_id, reply)

    async def reclaim(
        self, job_id: str, consumer: str, trainer_version: int, max_groups: int, max_bytes: int, min_idle: float
    ) -> tuple[list[common_pb2.Group], int]:
        keys, base = self._keys(job_id)
        # Rounded up, so a lease is never taken over before min_idle has passed.
        min_idle_ms = max(0, math.ceil(min_idle * 1000))
        reply = await self._reclaim(
            keys=keys, args=[base, consumer, trainer_version, max_groups, max_bytes, min_idle_ms]
        )
        return self._groups(job_id, reply)

    def _groups(self, job_id: str, reply: list) -> tuple[list[common_pb2.Group], int]:
        if reply[0] == b"nojob":
            raise self._no_job(job_id)
        return [common_pb2.Group.FromString(payload) for payload in reply[2]], int(reply[1])

    async def ack(self, job_id: str, group_ids: Sequence[str], weight_version: int) -> int:
        keys, base = self._keys(job_id)
        reply = await self._ack(keys=keys, args=[base, weight_version, *group_ids])
        status = reply[0].decode()
        if status == "nojob":
            raise self._no_job(job_id)
        if status == "notfound":
            raise NotFound(f"group {reply[1].decode()!r} was never put for job {job_id!r} (or is long forgotten)")
        if status == "held":
            raise FailedPrecondition(
                f"group {reply[1].decode()!r} of job {job_id!r} is held but was never sampled; "
                f"only leased groups can be acked"
            )
        if status == "dropped":
            raise FailedPrecondition(f"group {reply[1].decode()!r} of job {job_id!r} aged out; it cannot be acked")
        return int(reply[1])

    async def stats(self, job_id: str) -> BufferStats:
        keys, _ = self._keys(job_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.hgetall(keys[2])
            meta, held = await pipe.execute()
        if not meta:
            raise self._no_job(job_id)
        meta = {k.decode(): int(v) for k, v in meta.items()}
        return BufferStats(
            **{name: meta.get(name, 0) for name in _COUNTERS},
            latest_version=meta.get("latest_version", 0),
            max_groups=meta["max_groups"],
            max_age=meta["max_age"],
            held_versions={int(v): int(n) for v, n in held.items() if int(n) > 0},
        )

    async def close(self) -> None:
        await self._redis.aclose()
