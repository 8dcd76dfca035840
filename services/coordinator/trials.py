"""A finished agent trial as the collector takes it: its trajectory (scored, or masked with why), its
conversation, and the staged part of its tokens.

Guarantees: a trial that failed for the infrastructure (`invalid`) or for its external scaffold
(`scaffold_error`) carries no tokens and is masked (valid=False, an ERROR verdict) from training and every
statistic; a scaffold's failure is told apart by SCAFFOLD_ERROR_PREFIX, so it is counted as the scaffold's,
and keeps the tail of the scaffold's output; a part the endpoint staged for such a trial is kept in
`recorded_part`, for its deletion, never in `part`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from dockyard.agents.external import SCAFFOLD_ERROR_PREFIX, ScaffoldRun
from dockyard.api.common.v1 import common_pb2
from services.coordinator.endpoint_sessions import Recording
from services.coordinator.job_buffer import StagedPayload

log = structlog.get_logger()


@dataclass
class Trial:
    """A scored trial, and its conversation per segment as the endpoint rendered it ({messages, tools})."""

    trajectory: common_pb2.Trajectory
    conversation: list[dict] = field(default_factory=list)
    scaffold_error: str = ""  # why the external scaffold failed ("": it did not), its output's tail below
    output_tail: str = ""
    part: StagedPayload | None = None  # its token arrays, staged by the endpoint (None: in `trajectory`, or none)
    received_bytes: int = 0  # bytes of token arrays that came here from the endpoint
    recorded_part: StagedPayload | None = None  # a part the endpoint staged for a trial left without tokens

    def error_line(self) -> str:
        """The scaffold error with the end of its output, as the job's message would give it ("" if none)."""
        if not self.scaffold_error:
            return ""
        return f"{self.scaffold_error}; its output ends: {self.output_tail[-500:]!r}"


def invalid(trajectory_id: str, error: str) -> common_pb2.Trajectory:
    """An infrastructure failure: no tokens, no learning signal, masked from every statistic."""
    log.warning("an agent trial failed", trajectory=trajectory_id, error=error)
    return common_pb2.Trajectory(
        trajectory_id=trajectory_id,
        valid=False,
        verdict=common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message=error),
        finish_reason="error",
    )


def scaffold_error(
    trajectory_id: str, run: ScaffoldRun, error: str, scaffold: str, recorded: Recording | None = None
) -> Trial:
    """The scaffold's own failure: masked like an infrastructure error (no tokens, out of every statistic),
    marked so that it is counted as the scaffold's, with the tail of its output."""
    log.warning("an external scaffold failed", trajectory=trajectory_id, error=error, output=run.output_tail[-500:])
    trajectory = common_pb2.Trajectory(
        trajectory_id=trajectory_id,
        valid=False,
        verdict=common_pb2.Verdict(
            status=common_pb2.VERDICT_STATUS_ERROR, error_message=f"{SCAFFOLD_ERROR_PREFIX}{scaffold}: {error}"
        ),
        finish_reason=run.outcome.finish_reason,
    )
    part = recorded.part if recorded is not None else None  # staged, but no group will take it
    return Trial(trajectory, scaffold_error=error, output_tail=run.output_tail, recorded_part=part)
