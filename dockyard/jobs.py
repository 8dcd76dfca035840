"""Job states as the coordinator proto defines them (`dockyard.coordinator.v1.JobState`).

Guarantees: each constant is the proto enum's value, so it compares equal to the `state` of a
`Job` in any coordinator reply; FINISHED holds the states a job never leaves; `state_name` is
the enum's name without its `JOB_STATE_` prefix. Which moves between states are allowed is the
coordinator's job record's business, not this module's. JOB_ID is the one pattern of a job id,
checked by every service that takes one (an id is a folder name on the trainer and coordinator).
"""

from __future__ import annotations

import re

from dockyard.api.coordinator.v1 import coordinator_pb2

PENDING, RUNNING = coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    coordinator_pb2.JOB_STATE_SUCCEEDED,
    coordinator_pb2.JOB_STATE_FAILED,
    coordinator_pb2.JOB_STATE_CANCELLED,
)
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})
JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def job_id_error(job_id: str, field: str = "job_id") -> str | None:
    """What is wrong with `job_id`, or None when it is a valid id."""
    if not job_id:
        return f"{field} is empty"
    if not JOB_ID.match(job_id):
        return f"{field} {job_id[:80]!r} must match {JOB_ID.pattern} (lowercase letters, digits, dashes)"
    return None


def state_name(state: int) -> str:
    return coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_")
