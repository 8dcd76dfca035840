"""The agent workers' calls to the policy endpoint's session API, and a finished trial's recording.

    open(greedy, staging) ─POST /v1/sessions {staging}─> (session id, its key)
    recording(session, max_tokens):
        opened with staging ─POST /v1/sessions/{id}/stage─> StagedTrial: no token arrays here, the trial's
            part staged by the endpoint (dockyard/experience/agent_trial.py)
        else, or where the endpoint could not stage ─GET /v1/sessions/{id}/trajectory─> TrajectoryDocument
            ─trial_tokens (the budget cut), here─> the token arrays
        ─> Recording: status, turns, conversation, the cut trial's figures, and its trajectory message
    forget(session) ─DELETE /v1/sessions/{id}─>      discard(part) ─DEL in the data plane─>

Guarantees: the data plane a session stages to is named only here, by the service token, when the
session opens; the cut (grpo.max_trial_tokens) is trial_tokens' on either path, so a Recording's
message and staged part hold the same tokens the carried path would have (tests/contract: the
trainer's batch compared exactly); `received_bytes` counts the token arrays that came here (4 per
token id, logprob and weight version, 1 per loss-mask value, plus a routed segment's routing as it
came, base64, over the recorded segments; 0 when the endpoint staged them). An endpoint that cannot be
reached or answers an error is TrialLost; a reply that is not the contract's is a ContractError.
`discard` never raises: a part it cannot delete expires.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog
from redis.exceptions import RedisError

from dockyard.agents.contract import (
    SAMPLING_GREEDY,
    SAMPLING_HEADER,
    SessionOpened,
    SessionStatus,
    StagedTrial,
    TrajectoryDocument,
    TrialStaging,
)
from dockyard.agents.scaffold import TrialLost
from dockyard.agents.trajectory import (
    TrialTokens,
    metadata_message,
    trajectory_message,
    trial_summary,
    trial_tokens,
)
from dockyard.api.common.v1 import common_pb2
from dockyard.experience.data_plane import DataPlane
from services.coordinator.job_buffer import StagedPayload

log = structlog.get_logger()


@dataclass
class Recording:
    """A finished trial as the endpoint recorded it, its tokens cut to the budget: here, or staged there."""

    status: SessionStatus
    error: str
    turns: int
    invalid_actions: int
    sampled: bool  # any sampled token recorded (before the cut)
    conversation: list[dict[str, Any]]
    segments: int
    sampled_tokens: int
    total_tokens: int
    truncated: bool
    weight_version: int
    tokens: TrialTokens | None = None  # the arrays, when they came here
    part: StagedPayload | None = None  # the arrays, when the endpoint staged them
    received_bytes: int = 0

    def message(self, **fields: Any) -> common_pb2.Trajectory:
        """The trial's Trajectory with `fields`: with its arrays, or metadata only beside its staged part."""
        if self.tokens is not None:
            return trajectory_message(self.tokens, **fields)
        return metadata_message(self.weight_version, self.sampled_tokens, **fields)


def _carried(document: TrajectoryDocument, max_tokens: int) -> Recording:
    tokens = trial_tokens(document, max_tokens)
    return Recording(
        **trial_summary(document, tokens),
        tokens=tokens,
        received_bytes=sum(
            4 * (len(s.token_ids) + len(s.logprobs) + len(s.weight_versions)) + len(s.loss_mask) + len(s.routing)
            for s in document.segments
        ),
    )


def _staged(reply: StagedTrial) -> Recording:
    return Recording(
        status=reply.status,
        error=reply.error,
        turns=reply.turns,
        invalid_actions=reply.invalid_actions,
        sampled=reply.sampled,
        conversation=reply.conversation,
        segments=reply.segments,
        sampled_tokens=reply.sampled_tokens,
        total_tokens=reply.total_tokens,
        truncated=reply.truncated,
        weight_version=reply.weight_version,
        part=StagedPayload(reply.part_key, reply.part_bytes) if reply.part_key else None,
    )


@dataclass
class EndpointSessions:
    base: str  # the endpoint's base URL
    token: str  # the service token
    transport: httpx.AsyncBaseTransport | None = None  # None: the network
    _http: httpx.AsyncClient | None = field(default=None, init=False)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0), transport=self.transport)
        return self._http

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._http = None

    async def routing(self) -> dict | None:
        """GET /v1/routing (admission queue, sessions and KV pressure per replica); None without an answer."""
        try:
            reply = await self.http.get(f"{self.base}/v1/routing", headers=self._auth())
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None

    async def open(self, greedy: bool, staging: TrialStaging | None = None) -> tuple[str, str]:
        """(session id, its key) from POST /v1/sessions, greedy for all its turns when `greedy`, its trial
        staged where `staging` says; TrialLost when the endpoint cannot open one."""
        headers = {**self._auth(), **({SAMPLING_HEADER: SAMPLING_GREEDY} if greedy else {})}
        body = {"staging": staging.model_dump(mode="json")} if staging is not None else None
        try:
            reply = await self.http.post(f"{self.base}/v1/sessions", headers=headers, json=body)
        except httpx.HTTPError as exc:
            raise TrialLost(f"opening an endpoint session: {exc}") from exc
        if reply.status_code != 200:
            raise TrialLost(f"opening an endpoint session: {reply.status_code} {reply.text[:200]}")
        opened = SessionOpened.parse(reply.content)
        return opened.session_id, opened.api_key

    async def recording(self, session_id: str, max_tokens: int, staged: bool) -> Recording:
        """The finished trial (opened with staging: `staged`), its tokens cut to `max_tokens`."""
        if staged:
            reply = StagedTrial.parse(await self._call("POST", session_id, "stage"))
            if reply.staged:
                return _staged(reply)
            log.warning("the endpoint could not stage a trial; reading its tokens", session=session_id)
        return _carried(TrajectoryDocument.parse(await self._call("GET", session_id, "trajectory")), max_tokens)

    async def _call(self, method: str, session_id: str, what: str) -> bytes:
        try:
            reply = await self.http.request(
                method, f"{self.base}/v1/sessions/{session_id}/{what}", headers=self._auth()
            )
        except httpx.HTTPError as exc:
            raise TrialLost(f"reading session {session_id}'s {what}: {exc}") from exc
        if reply.status_code != 200:
            raise TrialLost(f"reading session {session_id}'s {what}: {reply.status_code} {reply.text[:200]}")
        return reply.content

    async def forget(self, session_id: str) -> None:
        if self._http is None:
            return
        try:
            await self._http.delete(f"{self.base}/v1/sessions/{session_id}", headers=self._auth())
        except httpx.HTTPError:
            pass  # the endpoint drops idle sessions itself


def staging_for(plane: DataPlane | None, job_id: str, trajectory_id: str, max_tokens: int) -> TrialStaging | None:
    """Where a training trial's session stages its tokens: the buffer's data plane (None: there is none)."""
    if plane is None:
        return None
    advertised = base64.b64encode(plane.advertised.SerializeToString(deterministic=True)).decode()
    return TrialStaging(data_plane=advertised, job_id=job_id, trajectory_id=trajectory_id, max_tokens=max_tokens)


async def discard(plane: DataPlane | None, parts: list[StagedPayload | None]) -> None:
    """Delete parts whose group will not be assembled; a Redis failure leaves them to their expiry."""
    for part in parts:
        if part is None or plane is None:
            continue
        try:
            await plane.discard(part.key)
        except (RedisError, OSError) as exc:
            log.warning("a staged trial part is left to expire", key=part.key, error=repr(exc))
