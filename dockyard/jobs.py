"""Job states as the coordinator proto defines them (`dockyard.coordinator.v1.JobState`).

Guarantees: each constant is the proto enum's value, so it compares equal to the `state` of a
`Job` in any coordinator reply; FINISHED holds the states a job never leaves; `state_name` is
the enum's name without its `JOB_STATE_` prefix. Which moves between states are allowed is the
coordinator's job record's business, not this module's.
"""

from __future__ import annotations

from dockyard.api.coordinator.v1 import coordinator_pb2

PENDING, RUNNING = coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    coordinator_pb2.JOB_STATE_SUCCEEDED,
    coordinator_pb2.JOB_STATE_FAILED,
    coordinator_pb2.JOB_STATE_CANCELLED,
)
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})


def state_name(state: int) -> str:
    return coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_")
