"""The Lua scripts of the Redis buffer backend (services/buffer/redis_backend.py), one per method.

    _COMMON    key names, version formatting and the bookkeeping every script shares
    PUT        store a group once (a repeat is a duplicate), refuse when full or from the future;
               take over a payload a writer staged in the data plane
    SAMPLE     lease held groups, oldest version first, dropping what aged out
    RECLAIM    take over pending groups idle long enough (XAUTOCLAIM), deleted ones counted
    ACK        acknowledge leased groups and move the job's clock
    REWIND     set the job's clock: forward as an ack moves it, back dropping every group generated after it
    CLOSE      delete every key of a job

Guarantees: each script runs atomically on the Redis server (EVALSHA), so every
method of the backend is one atomic step for all buffer processes sharing it;
the key layout and the invariants are documented in redis_backend.py.

Why over 400 lines: it is the Lua source only, one script per buffer method,
and every script begins with _COMMON; split apart, each file would repeat or import that shared
prelude, and reading one method's script beside the others is how their invariants are checked.
"""

from __future__ import annotations

_COMMON = r"""
local META, VERSIONS, HELD, INDEX, ENTRIES = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local BASE = ARGV[1]
local GROUP = 'buffer'

-- Lua 5.1 prints large numbers as 1e+15; versions must stay exact decimal strings.
local function fmt(n) return string.format('%d', n) end
local function stream_key(v) return BASE .. 'v:' .. v end
local function ids_key(v) return BASE .. 'ids:' .. v end
-- A group's payload lives in a key of its own, written and read outside the scripts: big
-- strings through Lua cost about twice what the same bytes cost a plain SET or MGET.
local function payload_key(gid) return BASE .. 'd:' .. gid end
local function meta_num(field) return tonumber(redis.call('HGET', META, field)) or 0 end
local function incr(field, by) if by ~= 0 then redis.call('HINCRBY', META, field, by) end end
local function fields(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end

local function held_of(v) return tonumber(redis.call('HGET', HELD, v)) or 0 end
local function add_held(v, by)
  if by == 0 then return end  -- Lua writes 0 - 0 as '-0', which HINCRBY refuses
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

-- Drops every held group of version v (its stream must exist); how many. Undelivered
-- entries have no PEL entry, so XDEL leaves nothing behind.
local function drop_held(v)
  local key = stream_key(v)
  local n = 0
  for _, e in ipairs(redis.call('XRANGE', key, '(' .. last_delivered(key), '+')) do
    redis.call('XDEL', key, e[1])
    redis.call('HSET', ids_key(v), fields(e[2])['g'], 'd')
    redis.call('DEL', payload_key(fields(e[2])['g']))
    redis.call('HDEL', ENTRIES, v .. '/' .. e[1])
    n = n + 1
  end
  add_held(v, -n)
  return n
end

-- A pending group that leaves without an ack: aged out, or deleted behind our back.
local function drop_pending(v, entry)
  local gid = redis.call('HGET', ENTRIES, v .. '/' .. entry)
  if gid then
    redis.call('HSET', ids_key(v), gid, 'd')
    redis.call('DEL', payload_key(gid))
  end
  redis.call('HDEL', ENTRIES, v .. '/' .. entry)
  incr('pending', -1)
  incr('dropped_stale', 1)
end

if redis.call('EXISTS', META) == 0 then return {'nojob'} end
"""

PUT = (
    _COMMON
    + r"""
-- ARGV[6] says where the payload is: '0' none (a whole Group); '1' the caller wrote it to
-- payload_key(gid) (SET NX) in the same transaction, just before this script: it stays only if the
-- group is now held or pending; '2' a writer staged it under ARGV[7] (ARGV[8] bytes): it is renamed
-- to payload_key(gid) when the group is held, deleted when the put is a duplicate or stale, and
-- left to its expiry when the put is refused (full, future: the writer retries with it).
local gid, v, metadata, size, has_payload = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local staged = ARGV[7]
if has_payload == '2' then
  local length = redis.call('STRLEN', staged)
  if length == 0 then return {'nostage'} end
  if length ~= tonumber(ARGV[8]) then return {'stagesize', fmt(length)} end
end
local function discard_stage() if has_payload == '2' then redis.call('DEL', staged) end end
local function refuse(reply)
  if has_payload == '1' then redis.call('DEL', payload_key(gid)) end
  return reply
end
local known = redis.call('HGET', INDEX, gid)
if known then
  incr('duplicate_puts', 1)
  discard_stage()
  local state = redis.call('HGET', ids_key(known), gid) or ''
  local kind = string.sub(state, 1, 1)
  if kind == 'h' or kind == 'p' then return {'duplicate'} end  -- SET NX kept the first payload
  return refuse({'duplicate'})
end
local version = tonumber(v)
local latest, max_age = meta_num('latest_version'), meta_num('max_age')
if version > latest then return refuse({'future', fmt(latest)}) end
if latest - version > max_age then
  if has_payload == '1' then redis.call('DEL', payload_key(gid)) end
  discard_stage()
  redis.call('HSET', ids_key(v), gid, 'd')
  redis.call('HSET', INDEX, gid, v)
  redis.call('ZADD', VERSIONS, version, v)
  incr('puts', 1)
  incr('dropped_stale', 1)
  return {'stale'}
end
local in_flight, max_groups = meta_num('held') + meta_num('pending'), meta_num('max_groups')
if in_flight >= max_groups then return refuse({'full', fmt(in_flight), fmt(max_groups)}) end
local key = stream_key(v)
if redis.call('EXISTS', key) == 0 then
  local created = redis.pcall('XGROUP', 'CREATE', key, GROUP, '0', 'MKSTREAM')
  if type(created) == 'table' and created.err and not string.find(created.err, 'BUSYGROUP') then
    return redis.error_reply(created.err)
  end
end
if has_payload == '2' then
  redis.call('RENAME', staged, payload_key(gid))
  redis.call('PERSIST', payload_key(gid))  -- RENAME keeps the staging expiry
end
local entry = redis.call('XADD', key, '*', 'g', gid, 's', size, 'p', metadata, 'd', has_payload == '0' and '0' or '1')
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

SAMPLE = (
    _COMMON
    + r"""
local consumer = ARGV[2]
local latest, max_age = advance(tonumber(ARGV[3]))
local max_groups, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local oldest_fresh = latest - max_age

local dropped = 0
for _, v in ipairs(redis.call('ZRANGEBYSCORE', VERSIONS, '-inf', '(' .. fmt(oldest_fresh))) do
  if held_of(v) > 0 then
    dropped = dropped + drop_held(v)
    free_stale_stream(v)
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
        out[#out + 1] = {f['g'], v, f['p'], f['d'] or '0'}
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

RECLAIM = (
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
        local f = fields(claimed[1][2])
        out[#out + 1] = {f['g'], lease.v, f['p'], f['d'] or '0'}
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

ACK = (
    _COMMON
    + r"""
local function state_of(gid)
  local v = redis.call('HGET', INDEX, gid)
  if not v then return nil end
  return v, redis.call('HGET', ids_key(v), gid)
end

-- ARGV: base, weight_version, '1' to check the lease (else '0'), the lease, group ids...
-- Only the job's trainer (its lease, set by take_lease) acks; checked first, so a refused ack leaves no trace.
if ARGV[3] == '1' and (ARGV[4] == '' or redis.call('HGET', META, 'trainer_lease') ~= ARGV[4]) then
  return {'lease', ''}
end
-- Check every id before changing anything, so a refused ack leaves no trace.
local leased = 0
for i = 5, #ARGV do
  local v, state = state_of(ARGV[i])
  if not state then return {'notfound', ARGV[i]} end
  local kind = string.sub(state, 1, 1)
  if kind == 'h' then return {'held', ARGV[i]} end
  if kind == 'd' then return {'dropped', ARGV[i]} end
  if kind == 'p' then leased = leased + 1 end
end
-- The clock moves with acked work only: an ack that acks nothing new cannot move it.
local clock = meta_num('latest_version')
if leased == 0 and tonumber(ARGV[2]) > clock then return {'unearned', fmt(clock)} end
local acked = 0
for i = 5, #ARGV do
  local gid = ARGV[i]
  local v, state = state_of(gid)
  local entry = string.match(state, '^p|([^|]+)|')
  if entry then
    local key = stream_key(v)
    redis.call('XACK', key, GROUP, entry)
    redis.call('XDEL', key, entry)
    redis.call('HSET', ids_key(v), gid, 'a')
    redis.call('DEL', payload_key(gid))
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

CLOSE = (
    _COMMON
    + r"""
-- Only held and pending groups have a payload key, and ENTRIES lists exactly those.
for _, gid in ipairs(redis.call('HVALS', ENTRIES)) do redis.call('DEL', payload_key(gid)) end
for _, v in ipairs(redis.call('ZRANGE', VERSIONS, 0, -1)) do redis.call('DEL', stream_key(v), ids_key(v)) end
redis.call('DEL', META, VERSIONS, HELD, INDEX, ENTRIES)
return {'ok'}
"""
)

REWIND = (
    _COMMON
    + r"""
local to = tonumber(ARGV[2])
if to > meta_num('latest_version') then  -- forward: the clock moves as an ack's would
  advance(to)
  return {'ok', 0}
end
redis.call('HSET', META, 'latest_version', fmt(to))
local dropped = 0
for _, v in ipairs(redis.call('ZRANGEBYSCORE', VERSIONS, '(' .. fmt(to), '+inf')) do
  local key = stream_key(v)
  if redis.call('EXISTS', key) == 1 then
    local n = drop_held(v)
    incr('dropped_stale', n)
    local pending = pending_of(v)
    if pending > 0 then
      for _, p in ipairs(redis.call('XPENDING', key, GROUP, '-', '+', pending)) do
        redis.call('XACK', key, GROUP, p[1])
        redis.call('XDEL', key, p[1])
        drop_pending(v, p[1])
      end
    end
    dropped = dropped + n + pending
    free_stale_stream(v)
  end
end
return {'ok', dropped}
"""
)

# KEYS: meta; ARGV: the new lease. 1 when set, 0 when the job is unknown (no max_groups).
TAKE_LEASE = r"""
if redis.call('HEXISTS', KEYS[1], 'max_groups') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'trainer_lease', ARGV[1])
return 1
"""
