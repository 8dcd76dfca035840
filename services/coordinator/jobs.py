"""Job records and their state machine.

    PENDING ─> RUNNING ─> SUCCEEDED | FAILED | CANCELLED
       └──────────────────────────────────────> CANCELLED

Guarantees: `transition` refuses any other move with FailedPrecondition, so a
finished job never changes state again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp

from dockyard.config import MasterConfig
from dockyard.coordinator.v1 import coordinator_pb2
from dockyard.rpc.errors import FailedPrecondition

PENDING, RUNNING = coordinator_pb2.JOB_STATE_PENDING, coordinator_pb2.JOB_STATE_RUNNING
SUCCEEDED, FAILED, CANCELLED = (
    coordinator_pb2.JOB_STATE_SUCCEEDED,
    coordinator_pb2.JOB_STATE_FAILED,
    coordinator_pb2.JOB_STATE_CANCELLED,
)
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})
_ALLOWED = {PENDING: {RUNNING, CANCELLED, FAILED}, RUNNING: {SUCCEEDED, FAILED, CANCELLED}}


def state_name(state: int) -> str:
    return coordinator_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


@dataclass
class JobRecord:
    job_id: str
    config: MasterConfig
    config_yaml: str
    run_dir: str
    state: int = PENDING
    step: int = 0
    weight_version: int = 0
    phase: str = "queued"
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    validation_metrics: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def transition(self, new: int, message: str = "") -> None:
        if new not in _ALLOWED.get(self.state, set()):
            raise FailedPrecondition(
                f"job {self.job_id} is {state_name(self.state)}; it cannot become {state_name(new)}"
            )
        self.state = new
        if message:
            self.message = message
        self.touch()

    def touch(self, **changes: object) -> None:
        for name, value in changes.items():
            setattr(self, name, value)
        self.updated = time.time()

    def to_proto(self, services: list[coordinator_pb2.ServiceStatus] | None = None) -> coordinator_pb2.Job:
        create_time, update_time = Timestamp(), Timestamp()
        create_time.FromNanoseconds(int(self.created * 1e9))
        update_time.FromNanoseconds(int(self.updated * 1e9))
        return coordinator_pb2.Job(
            job_id=self.job_id,
            state=self.state,
            step=self.step,
            max_steps=self.config.max_num_steps,
            weight_version=self.weight_version,
            phase=self.phase,
            metrics=self.metrics,
            validation_metrics=self.validation_metrics,
            services=services or [],
            message=self.message,
            run_dir=self.run_dir,
            create_time=create_time,
            update_time=update_time,
        )
