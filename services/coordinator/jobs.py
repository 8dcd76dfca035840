"""Job records and their state machine over the job states of dockyard.jobs.

    PENDING ─> RUNNING ─> SUCCEEDED | FAILED | CANCELLED
       └─────────────────────────────> FAILED | CANCELLED

Guarantees: `transition` refuses any other move with FailedPrecondition, so a
finished job never changes state again. Every change (`transition`, `touch`)
is reported to `on_change` (a transition as urgent), which is how the job store
learns what to persist; `to_document` / `from_document` round-trip every field
but the hook, the config rebuilt from its resolved YAML. A stored document whose
values do not fit (a config the bounds now refuse, a number beyond int64) is
refused by `from_document` with ValueError naming it, and `to_proto` never
raises: a record that cannot be shown in full is shown by id, state and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.config import MasterConfig, load_config_text
from dockyard.jobs import CANCELLED, FAILED, FINISHED, PENDING, RUNNING, SUCCEEDED, state_name
from dockyard.rpc.errors import FailedPrecondition

# Bumped when the stored document changes shape; older documents are refused by name.
DOCUMENT_VERSION = 1
INT64 = range(-(2**63), 2**63)
log = structlog.get_logger()
_ALLOWED = {PENDING: {RUNNING, CANCELLED, FAILED}, RUNNING: {SUCCEEDED, FAILED, CANCELLED}}


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
    # Failure signatures the latest step shows ("<name>: <what was seen>", dockyard/monitoring/signatures.py).
    warnings: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    # Where the runner's task stream stands (see JobRunner._mark_cursor); persisted with the job.
    cursor: dict[str, Any] = field(default_factory=dict)
    # The latest weight-sync group epoch handed out for this job; a recovered job starts past it.
    sync_epoch: int = 0
    on_change: Callable[[JobRecord, bool], None] | None = field(default=None, repr=False, compare=False)

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
        self.updated = time.time()
        self._changed(urgent=True)

    def touch(self, **changes: object) -> None:
        for name, value in changes.items():
            setattr(self, name, value)
        self.updated = time.time()
        self._changed(urgent=False)

    def _changed(self, urgent: bool) -> None:
        if self.on_change is not None:
            self.on_change(self, urgent)

    def to_document(self) -> dict[str, Any]:
        """Every persisted field as plain JSON values."""
        return {
            "version": DOCUMENT_VERSION,
            "job_id": self.job_id,
            "config_yaml": self.config_yaml,
            "run_dir": self.run_dir,
            "state": state_name(self.state),
            "step": self.step,
            "weight_version": self.weight_version,
            "phase": self.phase,
            "message": self.message,
            "metrics": dict(self.metrics),
            "validation_metrics": dict(self.validation_metrics),
            "warnings": list(self.warnings),
            "created": self.created,
            "updated": self.updated,
            "cursor": dict(self.cursor),
            "sync_epoch": self.sync_epoch,
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> JobRecord:
        """The record `to_document` wrote; ValueError names what is wrong with a bad document."""
        if doc.get("version") != DOCUMENT_VERSION:
            raise ValueError(f"job document version {doc.get('version')!r} is not {DOCUMENT_VERSION}")
        try:
            state = coordinator_pb2.JobState.Value(f"JOB_STATE_{doc['state']}")
            return cls(
                job_id=doc["job_id"],
                config=load_config_text(doc["config_yaml"], origin=f"stored job {doc['job_id']}"),
                config_yaml=doc["config_yaml"],
                run_dir=doc["run_dir"],
                state=state,
                step=_int64(doc, "step"),
                weight_version=_int64(doc, "weight_version"),
                phase=doc["phase"],
                message=doc["message"],
                metrics={k: float(v) for k, v in doc["metrics"].items()},
                validation_metrics={k: float(v) for k, v in doc["validation_metrics"].items()},
                warnings=[str(w) for w in doc.get("warnings", [])],  # absent from documents stored before it
                created=float(doc["created"]),
                updated=float(doc["updated"]),
                cursor=dict(doc["cursor"]),
                sync_epoch=_int64(doc, "sync_epoch"),
            )
        except KeyError as exc:
            raise ValueError(f"job document lacks {exc}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"job document {str(doc.get('job_id'))[:80]!r}: {exc}") from None

    def to_proto(self, services: list[coordinator_pb2.ServiceStatus] | None = None) -> coordinator_pb2.Job:
        try:
            return self._full_proto(services)
        except (ValueError, TypeError, OverflowError) as exc:
            log.error("job cannot be shown in full", job_id=self.job_id, error=str(exc))
            return coordinator_pb2.Job(
                job_id=self.job_id, state=self.state, message=f"this job's record cannot be shown: {exc}"
            )

    def _full_proto(self, services: list[coordinator_pb2.ServiceStatus] | None) -> coordinator_pb2.Job:
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
            warnings=self.warnings,
            services=services or [],
            message=self.message,
            run_dir=self.run_dir,
            create_time=create_time,
            update_time=update_time,
        )


def _int64(doc: dict[str, Any], key: str) -> int:
    value = int(doc[key])
    if value not in INT64:
        raise ValueError(f"{key} {value} does not fit int64")
    return value
