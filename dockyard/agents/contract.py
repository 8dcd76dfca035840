"""The policy endpoint's session contract: what the endpoint serves and an agent worker reads back.

    endpoint (services/endpoint) ──builds──> TrajectoryDocument ──JSON, GET /v1/sessions/{id}/trajectory──>
        coordinator (services/coordinator/agent_trials.py) ──TrajectoryDocument.parse──> trial_tokens
    coordinator ──POST /v1/sessions {SessionOpen: staging: TrialStaging}──> endpoint (where to stage, once)
    endpoint ──stages the cut tokens──> StagedTrial ──JSON, POST /v1/sessions/{id}/stage──> coordinator

The endpoint and the coordinator are separate services that may not import each other, so the
shapes both sides rely on, the session header and the session id's alphabet live here, once.
docs/endpoint-api.md documents the HTTP API these models travel over.

Guarantees:
- The JSON of each model is exactly what `model_dump(mode="json")` gives: its fields in the order
  declared here, nothing renamed. Within schema version 1 (`TRAJECTORY_SCHEMA_VERSION`) fields may
  be added, never removed, renamed or given another meaning; a reader ignores fields it does not know.
- A mixture-of-experts job that records routing (policy.record_routing, policy.routing_replay) has each
  segment's `routing`: base64 of the expert ids of every kept position but the last, laid out as
  common.v1.Trajectory.routing (dockyard/experience/routing_layout.py) with the document's
  `routing_shape`; "" and null elsewhere (a document without them reads as one without routing).
- `TrajectoryDocument.parse` and `SessionOpened.parse` accept a document only when every field is
  present with its type (a field added within the version takes its default when absent: the value
  that states what a document before it meant) and a segment's token lists are the same length; anything else (another
  schema version, an error body, garbled JSON) is a ContractError naming the version or the field.
  A document without `schema_version` (written before the field existed) reads as version 1.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

# The HTTP header that names a call's session (requests and replies).
SESSION_HEADER = "X-Dockyard-Session"
# The HTTP header of a completion's sampling law: every reply states what it was sampled with (the
# job's settings, `temperature=0.8 top_p=1 top_k=0`); a request from the service token may send
# SAMPLING_GREEDY in it (validation, never trained). Any other client value is ignored or refused.
SAMPLING_HEADER = "X-Dockyard-Sampling"
SAMPLING_GREEDY = "greedy"
# What a session id may be made of, and its longest length: the endpoint refuses any other id (400),
# and a worker that derives an id from a trajectory id replaces other characters.
SESSION_ID_CHARS = "A-Za-z0-9._:-"
SESSION_ID_MAX_LENGTH = 128
SESSION_ID_PATTERN = rf"^[{SESSION_ID_CHARS}]{{1,{SESSION_ID_MAX_LENGTH}}}$"
# The version of the trajectory document's shape (see the module docstring for what it promises).
TRAJECTORY_SCHEMA_VERSION = 1
# Why a recorded completion is not trained: its prompt was sent again (retry), the next prompt went on
# from its context without it (dropped), another choice of its turn was taken (unchosen), or the
# scaffold went back to an earlier point of the history (branch).
ABANDONED_REASONS = ("retry", "dropped", "unchosen", "branch")


class ContractError(ValueError):
    """A document that is not one of this contract's (another version, missing or mistyped fields)."""


class SessionStatus(StrEnum):
    OK = "ok"
    # The session's replica died and no other could go on with it: the trial is lost, not scored.
    INFRASTRUCTURE_ERROR = "infrastructure_error"


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    what: ClassVar[str] = "document"

    @classmethod
    def parse(cls, data: str | bytes | dict[str, Any]) -> Self:
        """The model of a JSON text or decoded object; ContractError saying what is wrong."""
        if isinstance(data, str | bytes):
            try:
                data = json.loads(data)
            except ValueError as exc:
                raise ContractError(f"not a {cls.what}: the body is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ContractError(f"not a {cls.what}: a JSON {type(data).__name__}, not an object")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'document'}: {e['msg']}" for e in exc.errors()[:5]
            )
            raise ContractError(f"not a {cls.what}: {problems}") from None

    def to_json(self) -> dict[str, Any]:
        """The JSON object served on the wire."""
        return self.model_dump(mode="json")


def _same_lengths(segment: SegmentTokens | Segment) -> None:
    lengths = {len(segment.token_ids), len(segment.loss_mask), len(segment.logprobs), len(segment.weight_versions)}
    if len(lengths) > 1:
        raise ValueError("token_ids, loss_mask, logprobs and weight_versions differ in length")


class RoutingShape(BaseModel):
    """The layout of the segments' routing: per position, `moe_layers` × `top_k` expert ids of `num_experts`."""

    moe_layers: int
    top_k: int
    num_experts: int


class Completion(BaseModel):
    """One sampled completion of a turn."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # Positions in token_ids the endpoint wrote rather than sampled (a thinking budget's closing tag):
    # context, never trained; their logprob is 0.0.
    forced: list[int] = []


class Turn(BaseModel):
    """One model call: its exact prompt ids, every completion, and the one the conversation went on with."""

    prompt_token_ids: list[int]
    # The weight version the call's reply reports, and every version that sampled it (a weight swap
    # during the call lists more than one).
    weight_version: int
    weight_versions: list[int]
    chosen: int
    completions: list[Completion]
    # The turn of the segment whose recorded ids this prompt extends (-1: none, the segment's first), and
    # how: "start", "reply" (after its chosen reply), "context" (its reply dropped: its prompt up to the
    # generation prompt) or "retry" (its prompt exactly).
    parent: int = -1
    extends: str = "start"
    # Whether the chosen completion is in the segment's tokens (the kept path), and if not why every
    # completion was left: "retry", "dropped" or "branch" (see ABANDONED_REASONS).
    trained: bool = True
    abandoned: str = ""


class Segment(BaseModel):
    """Turns whose tokens chain (each prompt extends an earlier turn's recorded ids); its tokens are the
    kept path: the history the latest turn was sampled in and its reply, abandoned replies left out."""

    # Why the segment started: "start", or why the last one could not go on ("history_changed",
    # "template", "images").
    reason: str
    # The conversation as the chat template rendered it: the last call's messages and the reply it
    # kept (what a run exports as a demonstration), and the tools it offered.
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    # Per token of the kept path: the id, 1 exactly on the sampled tokens the scaffold built on, the
    # sampled token's logprob (0.0 elsewhere) and the weight version that sampled it (-1 elsewhere).
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    turns: list[Turn]
    # The experts each kept position but the last was routed to, by the turn that first ran it (base64 of
    # the packed ids, the document's routing_shape); "": none recorded.
    routing: str = ""

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        _same_lengths(self)
        return self


class TrajectoryDocument(_Document):
    """A session's recording: GET /v1/sessions/{id}/trajectory."""

    what: ClassVar[str] = f"trajectory document (schema version {TRAJECTORY_SCHEMA_VERSION})"

    schema_version: int = TRAJECTORY_SCHEMA_VERSION
    session_id: str
    # Trained completions that were malformed actions, plus replies the scaffold dropped
    # (grpo.invalid_action_penalty).
    invalid_actions: int
    status: SessionStatus
    error: str  # why the session ended ("" while it is ok)
    turns: int
    # How many times each reason started a new segment after the first.
    splits: dict[str, int]
    segments: list[Segment]
    # Completions in no segment's tokens (not trained), per reason (ABANDONED_REASONS).
    abandoned: dict[str, int] = {}
    # The layout of the segments' routing; None: no routing recorded.
    routing_shape: RoutingShape | None = None

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != TRAJECTORY_SCHEMA_VERSION:
            raise ValueError(f"schema version {version}; this reader knows version {TRAJECTORY_SCHEMA_VERSION} only")
        return version


class SegmentTokens(BaseModel):
    """The token fields of a recorded segment: all a trial's tokens are built from."""

    model_config = ConfigDict(extra="ignore")

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    routing: str = ""

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        _same_lengths(self)
        return self


class RecordedTokens(_Document):
    """The token part of a trajectory document (a full document also reads as one)."""

    what: ClassVar[str] = "recorded trajectory"

    segments: list[SegmentTokens]
    routing_shape: RoutingShape | None = None


class SessionOpened(_Document):
    """POST /v1/sessions: a new session id and its session-scoped API key."""

    what: ClassVar[str] = "new session reply"

    session_id: str
    api_key: str


class TrialStaging(BaseModel):
    """Where the endpoint stages a session's trial tokens (docs/buffer.md, "Data plane"): sent only by the
    service token, when it opens the session (POST /v1/sessions, body `{"staging": ...}`)."""

    model_config = ConfigDict(extra="forbid")

    data_plane: str  # the buffer's GetDataPlane answer (serialized protobuf, base64): never a password
    job_id: str
    trajectory_id: str  # the trial's id in its group
    max_tokens: int  # grpo.max_trial_tokens: the trial's tokens are cut to this many (trial_tokens)


class SessionOpen(BaseModel):
    """The optional body of POST /v1/sessions."""

    model_config = ConfigDict(extra="forbid")

    staging: TrialStaging | None = None


class StagedTrial(_Document):
    """POST /v1/sessions/{id}/stage: a finished trial's recording without its token arrays, which the
    endpoint staged in the data plane (`part_key`, `part_bytes`), cut to the session's `max_tokens`."""

    what: ClassVar[str] = "staged trial"

    session_id: str
    status: SessionStatus
    error: str
    turns: int
    invalid_actions: int
    sampled: bool  # whether any recorded segment holds a sampled token (before the cut)
    conversation: list[dict[str, Any]]  # per recorded segment: its messages and tools
    # False: the endpoint could not stage (its Redis unreachable, the part refused): read the trajectory.
    staged: bool
    part_key: str  # "" when the cut left no segment (nothing staged)
    part_bytes: int
    # The cut trial's figures (dockyard/agents/trajectory.py TrialTokens).
    segments: int
    sampled_tokens: int
    total_tokens: int
    truncated: bool
    weight_version: int


class SessionDeleted(_Document):
    """DELETE /v1/sessions/{id}."""

    deleted: str
