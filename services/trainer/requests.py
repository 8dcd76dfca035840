"""What the trainer service accepts: checks of its requests, and their protos as domain types.

    TrainStep ─lease─> buffer Groups (metadata + packed payload) ─training_group─> TrainingGroup
        (services/trainer/experience.py)
    SupervisedStep.demonstrations ─demonstration_pairs─> [(prompt, completion)]
    job ids, step numbers, checkpoint metrics ─check_*─> InvalidArgument / FailedPrecondition

Guarantees: a job id outside dockyard.jobs.JOB_ID (it names folders), an empty or oversized
demonstration batch (more than MAX_DEMONSTRATIONS, or a demonstration longer than MAX_CHARS_PER_TOKEN
characters per context position: refused by its length, before any tokenizing) and more than
MAX_CHECKPOINT_METRICS, nameless or non-finite checkpoint metrics are INVALID_ARGUMENT naming the
field; a step that is not the policy's next is FAILED_PRECONDITION. Nothing here touches the policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from dockyard.api.common.v1 import common_pb2
from dockyard.api.trainer.v1 import trainer_pb2
from dockyard.experience import payload as packed
from dockyard.experience.routing_layout import RoutingShape, from_bytes
from dockyard.jobs import job_id_error
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument
from services.trainer.experience import Sample, Segment, TrainingGroup
from services.trainer.policy import PolicyTrainer

MAX_DEMONSTRATIONS = 65536
MAX_CHECKPOINT_METRICS = 1024
MAX_METRIC_NAME_CHARS = 256
# No token of any tokenizer covers more characters than this: a demonstration longer than this many
# characters per position cannot fit the context, so its length refuses it before the tokenizer runs.
MAX_CHARS_PER_TOKEN = 64
DEFAULT_POSITIONS = 131072  # the context assumed for a model that names none


def demonstration_pairs(
    demonstrations: Sequence[trainer_pb2.Demonstration], max_positions: int | None
) -> list[tuple[str, str]]:
    """(prompt, completion) of each demonstration; InvalidArgument for an empty, oversized or hollow batch.

    Sized before any tokenizing: a demonstration longer than MAX_CHARS_PER_TOKEN characters per position
    of the model's context cannot fit it whatever the tokenizer does, so it is refused by its length.
    """
    if not demonstrations:
        raise InvalidArgument("empty batch: no demonstrations to train on")
    if len(demonstrations) > MAX_DEMONSTRATIONS:
        raise InvalidArgument(f"demonstrations: {len(demonstrations)} in one step; at most {MAX_DEMONSTRATIONS}")
    max_chars = (max_positions or DEFAULT_POSITIONS) * MAX_CHARS_PER_TOKEN
    for i, demo in enumerate(demonstrations):
        if not demo.prompt or not demo.completion:
            raise InvalidArgument(f"demonstrations[{i}]: prompt and completion must both be non-empty")
        if (chars := len(demo.prompt) + len(demo.completion)) > max_chars:
            raise InvalidArgument(
                f"demonstrations[{i}]: prompt + completion is {chars} characters; at most {max_chars} "
                f"({MAX_CHARS_PER_TOKEN} per position of the model's {max_positions or DEFAULT_POSITIONS}), "
                "refused before tokenizing"
            )
    return [(d.prompt, d.completion) for d in demonstrations]


def training_group(group: common_pb2.Group, payload: bytes = b"") -> TrainingGroup:
    """A buffer group as the trainer trains on it; `payload`, when given, holds its token arrays (packed)."""
    if payload:
        return _from_payload(group, payload)
    samples = []
    for t in group.trajectories:
        shape = packed.shape_of(t.routing_shape) if t.HasField("routing_shape") else None
        samples.append(_sample(t, [_segment(part, shape) for part in (t, *t.later_segments)]))
    return TrainingGroup(group.group_id, samples)


def _segment(part: common_pb2.Trajectory | common_pb2.Segment, shape: RoutingShape | None) -> Segment:
    return Segment(
        list(part.prompt_token_ids),
        list(part.completion_token_ids),
        list(part.completion_logprobs),
        list(part.completion_loss_mask) or None,
        from_bytes(part.routing, shape) if part.routing and shape is not None else None,
    )


def _sample(t: common_pb2.Trajectory, rows: list[Segment]) -> Sample:
    """The sample of trajectory `t` (its metadata) whose token arrays are `rows`, its segments in order."""
    first = rows[0]
    return Sample(
        trajectory_id=t.trajectory_id,
        prompt_ids=first.prompt_ids,
        completion_ids=first.completion_ids,
        generation_logprobs=first.generation_logprobs,
        reward=t.reward,
        valid=t.valid,
        weight_version=t.weight_version,
        loss_mask=first.loss_mask,
        later_segments=rows[1:],
        routing=first.routing,
    )


def _from_payload(group: common_pb2.Group, payload: bytes) -> TrainingGroup:
    """The group straight from its packed arrays (no copy into the proto's repeated fields first)."""
    try:
        arrays = packed.unpack(payload)
    except packed.PayloadError as exc:
        raise InvalidArgument(f"group {group.group_id!r}: its payload is unreadable: {exc}") from None
    if len(arrays) != len(group.trajectories):
        raise InvalidArgument(
            f"group {group.group_id!r}: its payload holds {len(arrays)} trajectories, its metadata "
            f"{len(group.trajectories)}"
        )
    samples = []
    for t, segments in zip(group.trajectories, arrays, strict=True):
        rows = [
            Segment(
                s.prompt.tolist(),
                s.completion.tolist(),
                s.logprobs.tolist(),
                s.mask.tolist() if s.mask is not None else None,
                s.routing,
            )
            for s in segments
        ] or [Segment([], [], [])]  # a trial that failed before any token: an empty, invalid sample
        samples.append(_sample(t, rows))
    return TrainingGroup(group.group_id, samples)


def check_next_step(policy: PolicyTrainer, step: int) -> None:
    expected = policy.weight_version + 1
    if step != expected:
        raise FailedPrecondition(
            f"the trainer has taken {policy.weight_version} steps; the next step is {expected}, not {step}"
        )


def check_job_id(job_id: str) -> None:
    if error := job_id_error(job_id):
        raise InvalidArgument(error)


def check_metrics(metrics: Mapping[str, float]) -> None:
    """Checkpoint metrics rank checkpoints: a bounded number of finite values under short names."""
    if len(metrics) > MAX_CHECKPOINT_METRICS:
        raise InvalidArgument(f"metrics: {len(metrics)} entries; at most {MAX_CHECKPOINT_METRICS}")
    for name, value in metrics.items():
        if not name or len(name) > MAX_METRIC_NAME_CHARS:
            raise InvalidArgument(f"metrics: a name must be 1 to {MAX_METRIC_NAME_CHARS} characters, got {len(name)}")
        if not math.isfinite(value):
            raise InvalidArgument(f"metrics[{name!r}] is {value}, not a finite number")
