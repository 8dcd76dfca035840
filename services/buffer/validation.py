"""The buffer's checks of what a put carries: a group the trainer can train on, ids and versions in range.

    validate_group(group)            a whole Group: every field of every trajectory and segment
    validate_group(group, payload)   metadata beside its packed payload (dockyard.experience.checks)
    validate_group(group, staged=True)  metadata whose payload a writer staged in the data plane:
                                        checked by that writer (dockyard.experience.data_plane) before it staged it

Guarantees: every refusal is InvalidArgument naming the group, trajectory and field (or the request's
field: OpenJob's bounds, a consumer's name, a lease id's length); the rules
are the trainer's own (services/trainer/batch.py) minus the vocabulary, which the buffer does not
know, so a group accepted here never fails a batch. A segment's routing (a mixture-of-experts
policy's) must hold one row of its trajectory's routing_shape per position but the last: a length
that disagrees with the tokens is refused, naming both (in a payload, the layout itself fixes it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.checks import check_payload
from dockyard.jobs import job_id_error
from dockyard.rpc.errors import InvalidArgument
from services.buffer.backend import MAX_VERSION

DEFAULT_MAX_TRAJECTORY_TOKENS = 65536
# OpenJob's bounds: far above any real job (the config caps the age at 1000), far below what overflows.
MAX_JOB_GROUPS = 10_000_000
MAX_AGE_STEPS = 1000
MAX_CONSUMER_CHARS = 256  # a trainer's name, echoed in logs and stored with every lease
MAX_LEASE_ID_CHARS = 320  # a trainer lease: the consumer's name, "/", 32 hex digits (backend.new_lease_id)


def validate_group(
    group: common_pb2.Group,
    max_trajectory_tokens: int = DEFAULT_MAX_TRAJECTORY_TOKENS,
    payload: bytes | None = None,
    *,
    staged: bool = False,
) -> None:
    """Raise InvalidArgument unless `group` (with `payload`, its packed token arrays, if given) is a
    well-formed whole group the trainer can train on; `staged`: metadata whose payload is in the data plane.

    The trainer's own checks (services/trainer/batch.py) minus the vocabulary, which the buffer
    does not know: a group refused here never reaches a batch, so it cannot fail one.
    """
    require_job_id(group.job_id, "group.job_id")
    if not group.group_id:
        raise InvalidArgument("group.group_id is empty")
    if not group.trajectories:
        raise InvalidArgument(f"group {group.group_id!r} has no trajectories")
    if not 0 <= group.weight_version <= MAX_VERSION:
        raise InvalidArgument(
            f"group {group.group_id!r}: weight_version {group.weight_version} is not in [0, {MAX_VERSION}]"
        )
    for i, trajectory in enumerate(group.trajectories):
        where = f"group {group.group_id!r} trajectories[{i}] ({trajectory.trajectory_id!r})"
        if trajectory.weight_version < 0:
            raise InvalidArgument(f"{where}: weight_version {trajectory.weight_version} is negative")
        if payload is None and not staged:
            _check_trajectory(where, trajectory, max_trajectory_tokens)
        elif not math.isfinite(trajectory.reward):
            raise InvalidArgument(f"{where}: reward is {trajectory.reward}, not a finite number")
        elif staged and packed.has_tokens(trajectory):
            raise InvalidArgument(
                f"{where}: token arrays in the metadata beside a staged payload; send them in the payload only"
            )
    if payload is not None:
        check_payload(group, payload, max_trajectory_tokens)
    # The group's age is measured from its oldest trajectory; a different
    # stamp would let an over-age trajectory past the bound.
    oldest = min(t.weight_version for t in group.trajectories)
    if group.weight_version != oldest:
        raise InvalidArgument(
            f"group {group.group_id!r}: weight_version {group.weight_version} differs from the oldest "
            f"trajectory weight_version {oldest}; it must equal the minimum over its trajectories"
        )


def _check_trajectory(where: str, trajectory: common_pb2.Trajectory, max_tokens: int) -> None:
    if not math.isfinite(trajectory.reward):
        raise InvalidArgument(f"{where}: reward is {trajectory.reward}, not a finite number")
    if not trajectory.valid and not (
        trajectory.prompt_token_ids or trajectory.completion_token_ids or trajectory.later_segments
    ):
        return  # an infrastructure failure before any token (a failed agent trial): nothing to check
    tokens = 0
    shape = packed.shape_of(trajectory.routing_shape) if trajectory.HasField("routing_shape") else None
    for k, segment in enumerate([trajectory, *trajectory.later_segments]):
        at = where if k == 0 else f"{where} later_segments[{k - 1}]"
        tokens += _check_segment(at, segment)
        routing = packed.routing_error(
            shape, segment.routing, len(segment.prompt_token_ids), len(segment.completion_token_ids)
        )
        if routing:
            raise InvalidArgument(f"{at}: {routing}")
    if tokens > max_tokens:
        raise InvalidArgument(
            f"{where}: {tokens} tokens (prompt_token_ids + completion_token_ids over its segments); "
            f"at most {max_tokens} (DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS)"
        )


def _check_segment(where: str, segment: common_pb2.Trajectory | common_pb2.Segment) -> int:
    """Refuse a segment (a trajectory's own fields, or a later segment) the trainer cannot use; its token count."""
    prompt, completion = segment.prompt_token_ids, segment.completion_token_ids
    if not prompt:
        raise InvalidArgument(f"{where}: prompt_token_ids is empty")
    for field, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
        if ids and min(ids) < 0:
            raise InvalidArgument(f"{where}: {field} holds the negative token id {min(ids)}")
    if len(segment.completion_logprobs) != len(completion):
        raise InvalidArgument(
            f"{where}: {len(segment.completion_logprobs)} completion_logprobs for "
            f"{len(completion)} completion_token_ids; need one logprob per token"
        )
    mask = segment.completion_loss_mask
    if mask and len(mask) != len(completion):
        raise InvalidArgument(
            f"{where}: {len(mask)} completion_loss_mask values for {len(completion)} completion_token_ids; "
            "need one per token (or none: all sampled)"
        )
    if any(m not in (0, 1) for m in mask):
        raise InvalidArgument(f"{where}: completion_loss_mask holds {next(m for m in mask if m not in (0, 1))}; 0 or 1")
    if bad := _bad_logprob(segment.completion_logprobs):
        raise InvalidArgument(f"{where}: completion_logprobs holds {bad}; a logprob is a finite number <= 0")
    return len(prompt) + len(completion)


def _bad_logprob(logprobs: Sequence[float]) -> str | None:
    # `not x <= 0` is True for NaN as well as for positive values.
    if any(not x <= 0.0 for x in logprobs):
        return str(next(x for x in logprobs if not x <= 0.0))
    if logprobs and min(logprobs) == -math.inf:
        return "-inf"
    return None


def require_job_bounds(max_groups: int, max_age_steps: int) -> None:
    """OpenJob's capacity and age bound, each within its limit."""
    if not 1 <= max_groups <= MAX_JOB_GROUPS:
        raise InvalidArgument(f"max_groups must be in [1, {MAX_JOB_GROUPS}], got {max_groups}")
    if not 0 <= max_age_steps <= MAX_AGE_STEPS:
        raise InvalidArgument(f"max_trajectory_age_steps must be in [0, {MAX_AGE_STEPS}], got {max_age_steps}")


def require_consumer(consumer: str) -> None:
    if not consumer:
        raise InvalidArgument("consumer is empty: name the trainer that leases the groups")
    if len(consumer) > MAX_CONSUMER_CHARS:
        raise InvalidArgument(f"consumer is {len(consumer)} characters; at most {MAX_CONSUMER_CHARS}")


def require_lease_id(lease_id: str) -> None:
    """An AckGroups lease id within its length (whether it is the job's lease is the backend's check)."""
    if len(lease_id) > MAX_LEASE_ID_CHARS:
        raise InvalidArgument(f"lease_id is {len(lease_id)} characters; at most {MAX_LEASE_ID_CHARS}")


def require_job_id(job_id: str, field: str = "job_id") -> None:
    if error := job_id_error(job_id, field):
        raise InvalidArgument(error)


def require_version(field: str, version: int) -> None:
    if version < 0:
        raise InvalidArgument(f"{field} must be >= 0, got {version}")
    if version > MAX_VERSION:
        raise InvalidArgument(f"{field} {version} is beyond any job's {MAX_VERSION} steps")
