"""The packed payload of a GRPO group: its token arrays in one flat, versioned byte string.

    writer: split(group) ─> (metadata Group without token arrays, payload bytes)
            ─> the buffer's Redis (data_plane.py) + PutGroup(metadata), or PutGroupStream to the buffer
    buffer: stores both as sent, returns both as stored (by reference, or SampleGroupsStream)
    reader: unpack(payload) ─> per trajectory, per segment: numpy views (no copy) of the bytes

Layout (little-endian, every section 4-byte aligned, so every array is a view of the bytes):

    b"DYP" version(u8=1) | u32 T | u32 segments[T] | per segment: u32 prompt_len, u32 completion_len, u32 has_mask
    | i32 ids: each segment's prompt then completion ids | f32 logprobs: each segment's, one per completion token
    | u8 masks: those of the segments that have one, zero-padded to 4 bytes

Version 2 (written only when some segment carries routing, a mixture-of-experts policy's, so a dense
job's payloads stay byte for byte version 1): the third u32 of a segment is flags (bit 0: a mask,
bit 1: routing), and after the masks come

    | u32 moe_layers, u32 top_k, u32 num_experts (the routing shape, one per payload)
    | routing: those of the segments that have it, (prompt_len + completion_len - 1) × moe_layers × top_k
      expert ids each (u8, or u16 past 256 experts), zero-padded to 4 bytes

Columns, not rows: the reader (and the buffer's checks) see every token id, logprob and mask of a
group as one array each, so a check over a whole group is a handful of numpy reductions.

Guarantees: one writer and one reader, this module, agree on the layout by its version byte (versions 1
and 2 are read); a
trajectory's segments are its own fields then its later_segments, in order (a trajectory with no
tokens at all, a trial that failed before its first turn, has none); `merge(split(g))` gives back
`g` field for field; a payload that is not of this layout (wrong magic or version, truncated, counts
that do not add up to its length) raises PayloadError naming what is wrong, never returns garbage; a
segment whose routing is not one row per position but the last is refused when packed (`routing_error`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message

from dockyard.api.common.v1 import common_pb2
from dockyard.experience.routing_layout import RoutingShape

MAGIC = b"DYP"
VERSION = 2  # the newest version written; VERSION_PLAIN when no segment carries routing
VERSION_PLAIN = 1
CHUNK_BYTES = 1 << 20  # the size of each streamed piece: far below any gRPC message cap
_TOKEN_FIELDS = (
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "completion_loss_mask",
    "later_segments",
    "routing",
    "routing_shape",
)


class PayloadError(ValueError):
    """Bytes that are not a packed payload of this version."""


@dataclass(frozen=True)
class SegmentArrays:
    """One token sequence: prompt ids, completion ids, one logprob per completion token, the loss mask."""

    prompt: np.ndarray  # int32
    completion: np.ndarray  # int32
    logprobs: np.ndarray  # float32, len(completion)
    mask: np.ndarray | None  # uint8, len(completion); None: every completion token was sampled
    routing: np.ndarray | None = None  # [len(prompt) + len(completion) - 1, moe_layers, top_k]; None: not recorded


def _segments(trajectory: common_pb2.Trajectory) -> list[common_pb2.Trajectory | common_pb2.Segment]:
    if not (trajectory.prompt_token_ids or trajectory.completion_token_ids or trajectory.later_segments):
        return []
    return [trajectory, *trajectory.later_segments]


def _padded(n: int) -> int:
    return (n + 3) & ~3


def shape_of(message: common_pb2.RoutingShape) -> RoutingShape:
    return RoutingShape(message.moe_layers, message.top_k, message.num_experts)


def routing_error(shape: RoutingShape | None, routing: bytes, prompt_len: int, completion_len: int) -> str | None:
    """Why a segment's routing bytes do not fit its tokens (one row per position but the last); None if they do."""
    if not routing:
        return None
    if shape is None or shape.bytes_per_position == 0:
        return "routing is set but routing_shape is not (or has no layers or experts)"
    rows = max(prompt_len + completion_len - 1, 0)
    if len(routing) != rows * shape.bytes_per_position:
        return (
            f"routing holds {len(routing)} bytes; its {prompt_len} prompt and {completion_len} completion tokens "
            f"need {rows} positions × {shape.bytes_per_position} bytes ({shape.moe_layers} MoE layers × top "
            f"{shape.top_k} × {shape.dtype.itemsize} byte(s))"
        )
    if rows and (high := int(np.frombuffer(routing, dtype=shape.dtype).max())) >= shape.num_experts:
        return f"routing names expert {high}; the policy has {shape.num_experts} (0..{shape.num_experts - 1})"
    return None


def _payload_shape(trajectories: Sequence[common_pb2.Trajectory]) -> RoutingShape | None:
    """The one routing shape of the trajectories that carry routing; PayloadError if they disagree."""
    shapes = {shape_of(t.routing_shape) for t in trajectories if t.HasField("routing_shape")}
    if len(shapes) > 1:
        raise PayloadError(f"trajectories of one payload carry routing of different shapes: {sorted(map(str, shapes))}")
    return next(iter(shapes), None)


def pack(trajectories: Sequence[common_pb2.Trajectory]) -> bytes:
    """The payload of these trajectories' token arrays, in order."""
    segments = [_segments(t) for t in trajectories]
    flat = [s for per in segments for s in per]
    table = [len(per) for per in segments]
    shape = _payload_shape(trajectories)
    routed = shape is not None and any(s.routing for s in flat)
    for s in flat:
        n = len(s.completion_token_ids)
        if len(s.completion_logprobs) != n or (s.completion_loss_mask and len(s.completion_loss_mask) != n):
            raise PayloadError(
                f"a segment has {n} completion tokens, {len(s.completion_logprobs)} logprobs and "
                f"{len(s.completion_loss_mask)} loss mask values; need one logprob (and mask value) per token"
            )
        if error := routing_error(shape, s.routing, len(s.prompt_token_ids), n):
            raise PayloadError(f"a segment's {error}")
        table += [len(s.prompt_token_ids), n, int(bool(s.completion_loss_mask)) | (2 if s.routing else 0)]
    ids, logprobs, masks = [], [], []
    for s in flat:
        ids += [np.asarray(s.prompt_token_ids, dtype="<i4"), np.asarray(s.completion_token_ids, dtype="<i4")]
        logprobs.append(np.asarray(s.completion_logprobs, dtype="<f4"))
        if s.completion_loss_mask:
            masks.append(np.asarray(s.completion_loss_mask, dtype=np.int64))
    mask = np.concatenate(masks) if masks else np.zeros(0, np.int64)
    if mask.size and (mask.min() < 0 or mask.max() > 255):
        raise PayloadError(f"a loss mask holds {int(mask.min())}..{int(mask.max())}; 0 or 1")
    parts = [
        MAGIC,
        bytes([VERSION if routed else VERSION_PLAIN]),
        struct.pack(f"<I{len(table)}I", len(segments), *table),
        *(a.tobytes() for a in ids),
        *(a.tobytes() for a in logprobs),
        mask.astype(np.uint8).tobytes(),
        bytes(_padded(mask.size) - mask.size),
    ]
    if routed:
        assert shape is not None
        routing = b"".join(s.routing for s in flat)
        parts += [
            struct.pack("<3I", shape.moe_layers, shape.top_k, shape.num_experts),
            routing,
            bytes(_padded(len(routing)) - len(routing)),
        ]
    return b"".join(parts)


@dataclass(frozen=True)
class Columns:
    """A payload's arrays as whole columns, for checks over every token at once."""

    segments: tuple[int, ...]  # per trajectory, its number of segments
    table: np.ndarray  # (segments, 3) int64: prompt_len, completion_len, has_mask
    ids: np.ndarray  # int32: each segment's prompt then completion ids, in order
    logprobs: np.ndarray  # float32: each segment's completion logprobs, in order
    masks: np.ndarray  # uint8: the masks of the segments that have one, in order
    routed: np.ndarray | None = None  # (segments,) bool: the segment carries routing; None: version 1
    routing_shape: RoutingShape | None = None
    routing: np.ndarray | None = None  # the routed segments' expert ids, flat, in order (the shape's dtype)


def columns(data: bytes | memoryview) -> Columns:
    """The payload's columns (views of `data`); PayloadError if it is not of this layout."""
    if len(data) < 8 or bytes(data[:3]) != MAGIC:
        raise PayloadError(f"not a packed payload: {len(data)} bytes without the {MAGIC!r} header")
    version = data[3]
    if version not in (VERSION_PLAIN, VERSION):
        raise PayloadError(f"payload version {version}; this build reads versions {VERSION_PLAIN} and {VERSION}")
    (count,) = struct.unpack_from("<I", data, 4)
    offset = 8
    if offset + 4 * count > len(data):
        raise PayloadError(f"payload of {len(data)} bytes is truncated: its header names {count} trajectories")
    per = struct.unpack_from(f"<{count}I", data, offset)
    offset += 4 * count
    nseg = sum(per)
    if offset + 12 * nseg > len(data):
        raise PayloadError(f"payload of {len(data)} bytes is truncated: its header names {nseg} segments")
    table = np.frombuffer(data, dtype="<u4", count=3 * nseg, offset=offset).reshape(nseg, 3).astype(np.int64)
    offset += 12 * nseg
    routed = None
    if version == VERSION:
        routed = (table[:, 2] & 2) != 0
        table[:, 2] &= 1
    n_ids = int(table[:, 0].sum() + table[:, 1].sum())
    n_logprobs = int(table[:, 1].sum())
    n_masks = int(table[table[:, 2] != 0, 1].sum())
    expected = offset + 4 * n_ids + 4 * n_logprobs + _padded(n_masks)
    shape, routing = None, None
    if routed is not None:
        if expected + 12 > len(data):
            raise PayloadError(f"payload of {len(data)} bytes is truncated before its routing shape")
        shape = RoutingShape(*struct.unpack_from("<3I", data, expected))
        rows = np.maximum(table[routed, 0] + table[routed, 1] - 1, 0)
        n_routing = int(rows.sum()) * shape.moe_layers * shape.top_k
        routing_at = expected + 12
        expected = routing_at + _padded(n_routing * shape.dtype.itemsize)
    if expected != len(data):
        raise PayloadError(f"payload is {len(data)} bytes but its header describes {expected}")
    ids = np.frombuffer(data, dtype="<i4", count=n_ids, offset=offset)
    logprobs = np.frombuffer(data, dtype="<f4", count=n_logprobs, offset=offset + 4 * n_ids)
    masks = np.frombuffer(data, dtype=np.uint8, count=n_masks, offset=offset + 4 * (n_ids + n_logprobs))
    if shape is not None:
        routing = np.frombuffer(data, dtype=shape.dtype, count=n_routing, offset=routing_at)
    return Columns(per, table, ids, logprobs, masks, routed, shape, routing)


def unpack(data: bytes | memoryview) -> list[list[SegmentArrays]]:
    """Per trajectory, its segments as read-only numpy views of `data`."""
    c = columns(data)
    out: list[list[SegmentArrays]] = []
    rows = iter(c.table.tolist())
    routed = iter(c.routed.tolist() if c.routed is not None else [False] * len(c.table))
    at_id = at_logprob = at_mask = at_routing = 0
    for n in c.segments:
        segments = []
        for prompt_len, completion_len, has_mask in (next(rows) for _ in range(n)):
            prompt = c.ids[at_id : at_id + prompt_len]
            completion = c.ids[at_id + prompt_len : at_id + prompt_len + completion_len]
            logprobs = c.logprobs[at_logprob : at_logprob + completion_len]
            mask = c.masks[at_mask : at_mask + completion_len] if has_mask else None
            routing = None
            if next(routed):
                assert c.routing is not None and c.routing_shape is not None
                shape = c.routing_shape
                count = max(prompt_len + completion_len - 1, 0) * shape.moe_layers * shape.top_k
                flat = c.routing[at_routing : at_routing + count]
                routing = flat.reshape(-1, shape.moe_layers, shape.top_k)
                at_routing += count
            at_id += prompt_len + completion_len
            at_logprob += completion_len
            at_mask += completion_len if has_mask else 0
            segments.append(SegmentArrays(prompt, completion, logprobs, mask, routing))
        out.append(segments)
    return out


def has_tokens(trajectory: common_pb2.Trajectory) -> bool:
    """Whether a trajectory message carries any token array (metadata must not)."""
    return trajectory.HasField("routing_shape") or any(
        len(getattr(trajectory, name)) for name in _TOKEN_FIELDS if name != "routing_shape"
    )


def split(group: common_pb2.Group) -> tuple[common_pb2.Group, bytes]:
    """(the group without its token arrays, the payload of those arrays); `group` is left as it is."""
    metadata = _copy_except(group, {"trajectories"})
    for trajectory in group.trajectories:
        metadata.trajectories.append(_copy_except(trajectory, _TOKEN_FIELDS))
    return metadata, pack(group.trajectories)


def _copy_except(message: Message, skipped: set[str] | tuple[str, ...]) -> Message:
    """A copy of `message` without the fields named in `skipped`, never copying them first (they are the bulk)."""
    copy = type(message)()
    for field, value in message.ListFields():
        if field.name in skipped:
            continue
        if isinstance(value, Message):
            getattr(copy, field.name).CopyFrom(value)
        elif hasattr(value, "extend"):  # a repeated field (Group and Trajectory have no maps)
            getattr(copy, field.name).extend(value)
        else:
            setattr(copy, field.name, value)
    return copy


def merge(metadata: common_pb2.Group, data: bytes) -> common_pb2.Group:
    """The whole group: `metadata` (changed in place and returned) with the payload's token arrays filled in."""
    arrays = unpack(data)
    shape = columns(data).routing_shape
    if len(arrays) != len(metadata.trajectories):
        raise PayloadError(f"payload holds {len(arrays)} trajectories, the group {len(metadata.trajectories)}")
    for trajectory, segments in zip(metadata.trajectories, arrays, strict=True):
        targets = [trajectory] + [trajectory.later_segments.add() for _ in segments[1:]]
        for target, s in zip(targets[: len(segments)], segments, strict=True):
            target.prompt_token_ids.extend(s.prompt.tolist())
            target.completion_token_ids.extend(s.completion.tolist())
            target.completion_logprobs.extend(s.logprobs.tolist())
            if s.mask is not None:
                target.completion_loss_mask.extend(s.mask.tolist())
            if s.routing is not None:
                target.routing = s.routing.tobytes()
        if shape is not None and any(s.routing is not None for s in segments):
            trajectory.routing_shape.CopyFrom(
                common_pb2.RoutingShape(moe_layers=shape.moe_layers, top_k=shape.top_k, num_experts=shape.num_experts)
            )
    return metadata


def chunks(data: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`data` in pieces of at most `size` bytes (at least one piece, possibly empty)."""
    view = memoryview(data)
    yield bytes(view[:size])
    for start in range(size, len(data), size):
        yield bytes(view[start : start + size])
