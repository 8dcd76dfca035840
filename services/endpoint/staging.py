"""The endpoint's side of the experience data plane: a finished trial's tokens staged where its opener said.

    POST /v1/sessions {staging} (the service token only) ─> Session.staging: data plane, job, trial id, budget
    POST /v1/sessions/{id}/stage (the service token only) ─TrialStager.stage─>
        Session.document ─trial_tokens (cut to max_tokens)─> trajectory_message
        ─agent_trial.stage_part (pack, check, SET EX ttl)─> StagedTrial: the recording less its token arrays,
                                                            the part's key and bytes, the cut trial's figures

Guarantees: the endpoint writes only to a data plane the service token named when it opened the
session; nothing a session key or a model call sends names or changes it, and a session opened
without one stages nothing (the stage route is a 400). The password is read here
(DOCKYARD_DATA_PLANE_REDIS_PASSWORD[_FILE]), never carried by a request. The tokens staged are
trial_tokens' cut of the recording, the same function the coordinator applies to the trajectory it
reads without a data plane, so the trained tokens do not depend on which side cut them. Where staging
fails (the data plane unreachable, retried after Planes.RETRY_AFTER_S; the part refused by the
buffer's checks) the reply says `staged: false` and why is logged: the caller reads the trajectory
instead, and nothing recorded is lost. A part is staged per call under a fresh key; one whose group is
never put is deleted by the coordinator or expires (dockyard/experience/agent_trial.py).
"""

from __future__ import annotations

import base64

import structlog
from redis.exceptions import RedisError

from dockyard.agents.contract import SessionStatus, StagedTrial, TrialStaging
from dockyard.agents.trajectory import trajectory_message, trial_summary, trial_tokens
from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.experience.agent_trial import stage_part
from dockyard.experience.data_plane import Planes
from dockyard.rpc.errors import InvalidArgument
from services.endpoint.errors import BadRequest
from services.endpoint.sessions import Session

log = structlog.get_logger()


def advertised(staging: TrialStaging) -> buffer_pb2.GetDataPlaneResponse:
    """The data plane a session's opener named; BadRequest when it is not a GetDataPlane answer."""
    try:
        return buffer_pb2.GetDataPlaneResponse.FromString(base64.b64decode(staging.data_plane, validate=True))
    except ValueError as exc:  # binascii.Error and DecodeError are ValueErrors
        raise BadRequest(f"staging.data_plane is not a base64 GetDataPlaneResponse: {exc}") from None


class TrialStager:
    def __init__(self) -> None:
        self._planes = Planes()

    async def stage(self, session: Session) -> StagedTrial:
        """The session's trial, its tokens staged where its opener said (`staged: false` where they could not be)."""
        staging = session.staging
        if staging is None:
            raise BadRequest(f"session {session.id!r} was opened without staging: read its trajectory instead")
        document = session.document()
        tokens = trial_tokens(document, staging.max_tokens)
        # Nothing to stage: no tokens left after the cut, or a session that ended (the trial is lost anyway).
        nothing = not tokens.segments or document.status != SessionStatus.OK
        reply = StagedTrial(
            session_id=session.id, **trial_summary(document, tokens), staged=nothing, part_key="", part_bytes=0
        )
        if nothing:
            return reply
        plane = await self._planes.get(advertised(staging))
        if plane is None:
            return reply
        trajectory = trajectory_message(tokens, trajectory_id=staging.trajectory_id)
        try:
            reply.part_key, reply.part_bytes = await stage_part(plane, staging.job_id, trajectory)
            reply.staged = True
        except InvalidArgument as exc:
            # The coordinator's own check refuses it again, naming the same fault.
            log.warning("trial not staged: it fails the buffer's checks", session=session.id, error=str(exc))
        except (RedisError, OSError) as exc:
            log.warning("trial not staged: the data plane's Redis failed", session=session.id, error=repr(exc))
        return reply

    async def close(self) -> None:
        await self._planes.close()
