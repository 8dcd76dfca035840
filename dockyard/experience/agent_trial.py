"""An agent group's payload, staged one trial at a time and assembled in the data plane.

    endpoint, at a trial's end (the coordinator asks; the session was opened with where to stage):
        recording ─trial_tokens (the budget cut)─> Trajectory ─stage_part: pack, check, SET EX ttl─> part key
    coordinator, once every trial of the group ended:
        [part key | None per trial] ─assemble: one Lua script in Redis─> the group's staged key
        ─PutGroup(metadata, that key)─> buffer (as any staged payload: data_plane.py)

A part is the payload (payload.py) of one trajectory; `assemble` lays the group's parts out as the
payload of the whole group, byte for byte what `payload.pack` makes of the same trajectories (the
columns of each part, one after the other), so the buffer and the trainer read an agent group exactly
as they read any group. A trial with no tokens (it failed before its first sampled token) has no part
and no segment in the group's payload. Parts of payload versions 1 and 2 are read: a mixture-of-experts
job's parts carry routing (version 2: per-segment flags, the routing shape, the routed segments' ids),
and the group's payload is version 2, with the one shape and the parts' routing in order, as soon as
one part is (a version 1 part's mask flags are version 2's flags as they are; a part of another
routing shape than an earlier one is PartGone: the two cannot be one payload). The assembly copies the
bytes once inside Redis (no client holds them); a 16 MiB group blocks Redis for a few milliseconds.

Guarantees: a part is checked before it is staged (dockyard.experience.checks, as a valid trajectory:
the strictest case), so an assembled payload holds only what the trainer can train on; `assemble` is
atomic: it writes the group's key and deletes the parts in one script, or, when a part is gone
(expired: the group's trials outlasted DOCKYARD_BUFFER_STAGING_TTL_SECONDS) or is not a one-trajectory
payload, writes nothing, deletes nothing and raises PartGone (the caller makes the group again); the
group's key, like every staged key, expires unless a put takes it over; parts of a group that is not
assembled (a trial lost, the group made again) are deleted by their writer's caller, or expire.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.exceptions import ResponseError

from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.data_plane import DataPlane, PayloadGone

# KEYS[1]: the group's new staged key; KEYS[2..]: the parts, in trajectory order. ARGV[1]: the expiry in
# seconds; ARGV[2]: one character per trajectory, '1' when it has a part (the next key), '0' when not.
ASSEMBLE = """
local has, k, nmask, nrouting = ARGV[2], 2, 0, 0
local version, shape = 1, nil
local counts, tables, ids, logprobs, masks, routings = {}, {}, {}, {}, {}, {}
for t = 1, #has do
  if string.sub(has, t, t) == '1' then
    local p = redis.call('GET', KEYS[k])
    if not p then return redis.error_reply('PARTGONE ' .. KEYS[k]) end
    local v = string.sub(p, 1, 4)
    if string.len(p) < 12 or (v ~= 'DYP\\1' and v ~= 'DYP\\2') or struct.unpack('<I4', p, 5) ~= 1 then
      return redis.error_reply('PARTGONE not a one-trajectory payload: ' .. KEYS[k])
    end
    local nseg = struct.unpack('<I4', p, 9)
    local at, nid, nlp, nm, nr = 13, 0, 0, 0, 0
    for s = 1, nseg do
      local prompt, completion, flags = struct.unpack('<I4I4I4', p, at)
      at = at + 12
      nid = nid + prompt + completion
      nlp = nlp + completion
      if v == 'DYP\\1' then
        if flags ~= 0 then nm = nm + completion end
      else
        if flags % 2 == 1 then nm = nm + completion end
        if math.floor(flags / 2) % 2 == 1 then nr = nr + math.max(prompt + completion - 1, 0) end
      end
    end
    local size = at - 1 + 4 * (nid + nlp) + nm + (4 - nm % 4) % 4
    local routing = ''
    if v == 'DYP\\2' then
      if string.len(p) < size + 12 then
        return redis.error_reply('PARTGONE its length does not match its header: ' .. KEYS[k])
      end
      local this = string.sub(p, size + 1, size + 12)
      if shape and shape ~= this then
        return redis.error_reply('PARTGONE its routing shape differs from an earlier one: ' .. KEYS[k])
      end
      shape, version = this, 2
      local layers, topk, experts = struct.unpack('<I4I4I4', this, 1)
      local width = 1
      if experts > 256 then width = 2 end
      local nbytes = nr * layers * topk * width
      routing = string.sub(p, size + 13, size + 12 + nbytes)
      size = size + 12 + nbytes + (4 - nbytes % 4) % 4
    end
    if string.len(p) ~= size then
      return redis.error_reply('PARTGONE its length does not match its header: ' .. KEYS[k])
    end
    counts[#counts + 1] = struct.pack('<I4', nseg)
    tables[#tables + 1] = string.sub(p, 13, at - 1)
    ids[#ids + 1] = string.sub(p, at, at + 4 * nid - 1)
    at = at + 4 * nid
    logprobs[#logprobs + 1] = string.sub(p, at, at + 4 * nlp - 1)
    at = at + 4 * nlp
    masks[#masks + 1] = string.sub(p, at, at + nm - 1)
    routings[#routings + 1] = routing
    nmask = nmask + nm
    nrouting = nrouting + string.len(routing)
    k = k + 1
  else
    counts[#counts + 1] = struct.pack('<I4', 0)
  end
end
local parts = {'DYP' .. string.char(version), struct.pack('<I4', #has), table.concat(counts), table.concat(tables),
  table.concat(ids), table.concat(logprobs), table.concat(masks), string.rep('\\0', (4 - nmask % 4) % 4)}
if version == 2 then
  parts[#parts + 1] = shape
  parts[#parts + 1] = table.concat(routings)
  parts[#parts + 1] = string.rep('\\0', (4 - nrouting % 4) % 4)
end
local out = table.concat(parts)
redis.call('SET', KEYS[1], out, 'EX', ARGV[1])
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
return string.len(out)
"""


class PartGone(PayloadGone):
    """A trial's staged part is gone (expired) or unreadable: the group cannot be assembled, only made again."""


async def stage_part(plane: DataPlane, job_id: str, trajectory: common_pb2.Trajectory) -> tuple[str, int]:
    """Pack one trial's token arrays, check them (InvalidArgument naming what is wrong) and stage them;
    (the part's key, its bytes). `trajectory` is left as it is."""
    metadata, payload = packed.split(
        common_pb2.Group(group_id=trajectory.trajectory_id, job_id=job_id, trajectories=[trajectory])
    )
    metadata.trajectories[0].valid = True  # the strictest check: no verdict has made it invalid yet
    return await plane.stage(metadata, payload), len(payload)


async def assemble(plane: DataPlane, job_id: str, group_id: str, parts: Sequence[str | None]) -> tuple[str, int]:
    """The group's payload, assembled from its trials' parts (None: a trial without tokens) under a fresh
    staging key, the parts deleted; (the key, its bytes). PartGone (nothing changed) if a part is gone."""
    key = plane.staging_key(job_id, group_id)
    keys = [key, *(p for p in parts if p is not None)]
    has = "".join("0" if p is None else "1" for p in parts)
    try:
        size = await plane.run_script(ASSEMBLE, keys, [plane.ttl, has])
    except ResponseError as exc:
        if "PARTGONE" not in str(exc):
            raise
        raise PartGone(f"group {group_id!r}: {exc}") from None
    return key, int(size)
