"""The checks of a group's packed payload (dockyard/experience/payload.py), before anyone stores it.

    buffer:             PutGroupStream(metadata Group, payload bytes) ─check_payload─> store
    data-plane writer:  check_payload ─> stage in Redis ─> PutGroup(metadata, key)   (data_plane.py)
        check_payload: numpy reductions over every token at once; only when one fails, check_segments
        per segment ─> InvalidArgument naming group, trajectory, field

Guarantees: the same rules as services/buffer/validation.py's checks of a whole Group (a non-empty
prompt per segment, no negative token id, finite logprobs <= 0, a 0/1 loss mask, at most
max_tokens per trajectory, routing naming only experts of its shape), applied with numpy to the
arrays as stored, so a payload the buffer
accepts is one the trainer can train on; a payload that is not of the layout, whose trajectory count
differs from the metadata's, or beside metadata that still carries token arrays, is refused.
"""

from __future__ import annotations

import numpy as np

from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.rpc.errors import InvalidArgument


def check_payload(group: common_pb2.Group, data: bytes, max_tokens: int) -> None:
    """Refuse a payload (and metadata beside it) the trainer could not train on, naming group, trajectory, field.

    Every token of the group is checked at once, column by column; only a payload that fails is
    walked segment by segment to name where.
    """
    try:
        c = packed.columns(data)
    except packed.PayloadError as exc:
        raise InvalidArgument(f"group {group.group_id!r}: its payload is unreadable: {exc}") from None
    if len(c.segments) != len(group.trajectories):
        raise InvalidArgument(
            f"group {group.group_id!r}: its payload holds {len(c.segments)} trajectories, its metadata "
            f"{len(group.trajectories)}; pack the group's own trajectories (dockyard.experience.payload.split)"
        )
    for i, trajectory in enumerate(group.trajectories):
        if packed.has_tokens(trajectory):
            raise InvalidArgument(
                f"group {group.group_id!r} trajectories[{i}]: token arrays in the metadata beside a payload; "
                "send them in the payload only (dockyard.experience.payload.split)"
            )
    per_trajectory = np.add.reduceat(c.table[:, 0] + c.table[:, 1], _starts(c.segments)) if len(c.table) else []
    lp = c.logprobs
    bad = (
        any(n == 0 and t.valid for n, t in zip(c.segments, group.trajectories, strict=True))
        or (len(c.table) and c.table[:, 0].min() == 0)
        or (c.ids.size and c.ids.min() < 0)
        or (c.masks.size and c.masks.max() > 1)
        or (lp.size and not (lp.max() <= 0.0 and lp.min() > -np.inf))  # NaN fails `<=` too
        or any(n > max_tokens for n in per_trajectory)
    )
    if c.routing is not None and c.routing.size and c.routing_shape is not None:
        if (high := int(c.routing.max())) >= c.routing_shape.num_experts:
            raise InvalidArgument(
                f"group {group.group_id!r}: its routing names expert {high}; the policy has "
                f"{c.routing_shape.num_experts} (0..{c.routing_shape.num_experts - 1})"
            )
    if bad:
        for i, (trajectory, segments) in enumerate(zip(group.trajectories, packed.unpack(data), strict=True)):
            where = f"group {group.group_id!r} trajectories[{i}] ({trajectory.trajectory_id!r})"
            check_segments(where, trajectory.valid, segments, max_tokens)
        raise AssertionError("a payload check failed over the columns but on no segment")


def _starts(segments: tuple[int, ...]) -> list[int]:
    """The first table row of each trajectory that has segments (reduceat skips those without)."""
    starts, at = [], 0
    for n in segments:
        if n:
            starts.append(at)
        at += n
    return starts


def check_segments(where: str, valid: bool, segments: list[packed.SegmentArrays], max_tokens: int) -> None:
    """Refuse a trajectory's segments the trainer cannot use (none at all only for an invalid trajectory)."""
    if not segments:
        if valid:
            raise InvalidArgument(
                f"{where}: a valid trajectory with no tokens in the payload; prompt_token_ids is empty"
            )
        return
    tokens = 0
    for k, s in enumerate(segments):
        at = where if k == 0 else f"{where} later_segments[{k - 1}]"
        if not s.prompt.size:
            raise InvalidArgument(f"{at}: prompt_token_ids is empty")
        for field, ids in (("prompt_token_ids", s.prompt), ("completion_token_ids", s.completion)):
            if ids.size and (low := int(ids.min())) < 0:
                raise InvalidArgument(f"{at}: {field} holds the negative token id {low}")
        if s.mask is not None and s.mask.size and (high := int(s.mask.max())) > 1:
            raise InvalidArgument(f"{at}: completion_loss_mask holds {high}; 0 or 1")
        if s.logprobs.size and not (bool(np.all(s.logprobs <= 0.0)) and not bool(np.isneginf(s.logprobs).any())):
            bad = s.logprobs[~(s.logprobs <= 0.0) | np.isneginf(s.logprobs)][0]
            raise InvalidArgument(f"{at}: completion_logprobs holds {bad}; a logprob is a finite number <= 0")
        tokens += s.prompt.size + s.completion.size
    if tokens > max_tokens:
        raise InvalidArgument(
            f"{where}: {tokens} tokens (prompt_token_ids + completion_token_ids over its segments); "
            f"at most {max_tokens} (DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS)"
        )
