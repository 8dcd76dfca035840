"""The packed payload of a GRPO group: its token arrays in one flat, versioned byte string.

    writer: split(group) ─> (metadata Group without token arrays, payload bytes)
            ─> the buffer's Redis (data_plane.py) + PutGroup(metadata), or PutGroupStream to the buffer
    buffer: stores both as sent, returns both as stored (by reference, or SampleGroupsStream)
    reader: unpack(payload) ─> per trajectory, per segment: numpy views (no copy) of the bytes

Layout (little-endian, every section 4-byte aligned, so every array is a view of the bytes):

    b"DYP" version(u8=1) | u32 T | u32 segments[T] | per segment: u32 prompt_len, u32 completion_len, u32 has_mask
    | i32 ids: each segment's prompt then completion ids | f32 logprobs: each segment's, one per completion token
    | u8 masks: those of the segments that have one, zero-padded to 4 bytes

Columns, not rows: the reader (and the buffer's checks) see every token id, logprob and mask of a
group as one array each, so a check over a whole group is a handful of numpy reductions.

Guarantees: one writer and one reader, this module, agree on the layout by its version byte; a
trajectory's segments are its own fields then its later_segments, in order (a trajectory with no
tokens at all, a trial that failed before its first turn, has none); `merge(split(g))` gives back
`g` field for field; a payload that is not of this layout (wrong magic or version, truncated, counts
that do not add up to its length) raises PayloadError naming what is wrong, never returns garbage.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import Message

from dockyard.api.common.v1 import common_pb2

MAGIC = b"DYP"
VERSION = 1
CHUNK_BYTES = 1 << 20  # the size of each streamed piece: far below any gRPC message cap
_TOKEN_FIELDS = (
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "completion_loss_mask",
    "later_segments",
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


def _segments(trajectory: common_pb2.Trajectory) -> list[common_pb2.Trajectory | common_pb2.Segment]:
    if not (trajectory.prompt_token_ids or trajectory.completion_token_ids or trajectory.later_segments):
        return []
    return [trajectory, *trajectory.later_segments]


def _padded(n: int) -> int:
    return (n + 3) & ~3


def pack(trajectories: Sequence[common_pb2.Trajectory]) -> bytes:
    """The payload of these trajectories' token arrays, in order."""
    segments = [_segments(t) for t in trajectories]
    flat = [s for per in segments for s in per]
    table = [len(per) for per in segments]
    for s in flat:
        n = len(s.completion_token_ids)
        if len(s.completion_logprobs) != n or (s.completion_loss_mask and len(s.completion_loss_mask) != n):
            raise PayloadError(
                f"a segment has {n} completion tokens, {len(s.completion_logprobs)} logprobs and "
                f"{len(s.completion_loss_mask)} loss mask values; need one logprob (and mask value) per token"
            )
        table += [len(s.prompt_token_ids), n, int(bool(s.completion_loss_mask))]
    ids, logprobs, masks = [], [], []
    for s in flat:
        ids += [np.asarray(s.prompt_token_ids, dtype="<i4"), np.asarray(s.completion_token_ids, dtype="<i4")]
        logprobs.append(np.asarray(s.completion_logprobs, dtype="<f4"))
        if s.completion_loss_mask:
            masks.append(np.asarray(s.completion_loss_mask, dtype=np.int64))
    mask = np.concatenate(masks) if masks else np.zeros(0, np.int64)
    if mask.size and (mask.min() < 0 or mask.max() > 255):
        raise PayloadError(f"a loss mask holds {int(mask.min())}..{int(mask.max())}; 0 or 1")
    return b"".join(
        [
            MAGIC,
            bytes([VERSION]),
            struct.pack(f"<I{len(table)}I", len(segments), *table),
            *(a.tobytes() for a in ids),
            *(a.tobytes() for a in logprobs),
            mask.astype(np.uint8).tobytes(),
            bytes(_padded(mask.size) - mask.size),
        ]
    )


@dataclass(frozen=True)
class Columns:
    """A payload's arrays as whole columns, for checks over every token at once."""

    segments: tuple[int, ...]  # per trajectory, its number of segments
    table: np.ndarray  # (segments, 3) int64: prompt_len, completion_len, has_mask
    ids: np.ndarray  # int32: each segment's prompt then completion ids, in order
    logprobs: np.ndarray  # float32: each segment's completion logprobs, in order
    masks: np.ndarray  # uint8: the masks of the segments that have one, in order


def columns(data: bytes | memoryview) -> Columns:
    """The payload's columns (views of `data`); PayloadError if it is not of this layout."""
    if len(data) < 8 or bytes(data[:3]) != MAGIC:
        raise PayloadError(f"not a packed payload: {len(data)} bytes without the {MAGIC!r} header")
    if data[3] != VERSION:
        raise PayloadError(f"payload version {data[3]}; this build reads version {VERSION}")
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
    n_ids = int(table[:, 0].sum() + table[:, 1].sum())
    n_logprobs = int(table[:, 1].sum())
    n_masks = int(table[table[:, 2] != 0, 1].sum())
    expected = offset + 4 * n_ids + 4 * n_logprobs + _padded(n_masks)
    if expected != len(data):
        raise PayloadError(f"payload is {len(data)} bytes but its header describes {expected}")
    ids = np.frombuffer(data, dtype="<i4", count=n_ids, offset=offset)
    logprobs = np.frombuffer(data, dtype="<f4", count=n_logprobs, offset=offset + 4 * n_ids)
    masks = np.frombuffer(data, dtype=np.uint8, count=n_masks, offset=offset + 4 * (n_ids + n_logprobs))
    return Columns(per, table, ids, logprobs, masks)


def unpack(data: bytes | memoryview) -> list[list[SegmentArrays]]:
    """Per trajectory, its segments as read-only numpy views of `data`."""
    c = columns(data)
    out: list[list[SegmentArrays]] = []
    rows = iter(c.table.tolist())
    at_id = at_logprob = at_mask = 0
    for n in c.segments:
        segments = []
        for prompt_len, completion_len, has_mask in (next(rows) for _ in range(n)):
            prompt = c.ids[at_id : at_id + prompt_len]
            completion = c.ids[at_id + prompt_len : at_id + prompt_len + completion_len]
            logprobs = c.logprobs[at_logprob : at_logprob + completion_len]
            mask = c.masks[at_mask : at_mask + completion_len] if has_mask else None
            at_id += prompt_len + completion_len
            at_logprob += completion_len
            at_mask += completion_len if has_mask else 0
            segments.append(SegmentArrays(prompt, completion, logprobs, mask))
        out.append(segments)
    return out


def has_tokens(trajectory: common_pb2.Trajectory) -> bool:
    """Whether a trajectory message carries any token array (metadata must not)."""
    return any(len(getattr(trajectory, name)) for name in _TOKEN_FIELDS)


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
    return metadata


def chunks(data: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`data` in pieces of at most `size` bytes (at least one piece, possibly empty)."""
    view = memoryview(data)
    yield bytes(view[:size])
    for start in range(size, len(data), size):
        yield bytes(view[start : start + size])
