"""An endpoint session's recorded trajectory as the common Trajectory's token fields.

    GET /v1/sessions/{id}/trajectory ──> segments[(token_ids, loss_mask, logprobs, weight_versions)]
        ──trial_tokens──> first segment: prompt = tokens before the first sampled one, completion = the rest
                          later segments: the same, each on its own
        ──trajectory_message──> common_pb2.Trajectory (first segment in its own fields, the rest as
                                later_segments; weight_version, sampled_tokens), what an agent trial puts in
                                its group; with a data plane the endpoint runs both (services/endpoint/staging.py)
                                and stages the arrays, and the coordinator makes metadata_message's

Guarantees: token ids, the loss mask (1 exactly on the sampled tokens of each segment's kept path) and
the sampled tokens' logprobs are taken as the endpoint recorded them, never re-tokenized; context tokens
get logprob 0.0; the whole trajectory is cut to at most `max_tokens` unique tokens: a segment's tokens
count from where it stops sharing a prefix with an earlier segment (so a history the scaffold edited
counts its repeated context once, and each row still fits `max_tokens` positions); the cut keeps time
order (after a cut segment nothing later is kept; one left with no sampled token is dropped); the weight
version is the oldest that sampled any kept token. A segment's routing (a mixture-of-experts job's:
one row per position but the last, base64 in the document) is cut with its tokens, so a kept segment
of n tokens keeps n - 1 rows, and travels as the Trajectory's `routing` (the first segment) and each
later Segment's, with the document's `routing_shape`. A recording is read through the contract's models
(dockyard/agents/contract.py): one that does not fit is a ContractError.
"""

from __future__ import annotations

import base64
import binascii
import bisect
from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.contract import ContractError, RecordedTokens, TrajectoryDocument
from dockyard.api.common.v1 import common_pb2
from dockyard.experience.routing_layout import RoutingShape


@dataclass
class TrialSegment:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    routing: bytes = b""  # the expert ids of every position but the last (routing_shape); b"": none recorded


@dataclass
class TrialTokens:
    segments: list[TrialSegment] = field(default_factory=list)
    routing_shape: RoutingShape | None = None  # the layout of the segments' routing; None: none recorded
    weight_version: int = 0
    truncated: bool = False
    unique_tokens: int = 0  # what the budget counts: each token of the rows' common prefixes once

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    @property
    def total_tokens(self) -> int:
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in self.segments)


def trial_summary(document: TrajectoryDocument, tokens: TrialTokens) -> dict[str, Any]:
    """What a finished trial is reported by, wherever its token arrays go: the document's outcome and
    conversation, and the figures of `tokens` (the document cut to its budget by trial_tokens)."""
    return {
        "status": document.status,
        "error": document.error,
        "turns": document.turns,
        "invalid_actions": document.invalid_actions,
        "sampled": any(1 in s.loss_mask for s in document.segments),  # before the cut
        "conversation": [{"messages": s.messages, "tools": s.tools} for s in document.segments],
        "segments": len(tokens.segments),
        "sampled_tokens": tokens.sampled_tokens,
        "total_tokens": tokens.total_tokens,
        "truncated": tokens.truncated,
        "weight_version": tokens.weight_version,
    }


def trial_tokens(recorded: TrajectoryDocument | RecordedTokens | dict[str, Any], max_tokens: int) -> TrialTokens:
    """The segments of a recorded session (a document, or its decoded JSON), cut to `max_tokens` unique tokens."""
    if isinstance(recorded, dict):
        recorded = RecordedTokens.parse(recorded)
    out = TrialTokens()
    shape = recorded.routing_shape
    if shape is not None:
        out.routing_shape = RoutingShape(shape.moe_layers, shape.top_k, shape.num_experts)
    versions: list[int] = []
    rows: list[list[int]] = []  # every segment's kept ids, sorted: the longest shared prefix is a neighbour's
    for segment in recorded.segments:
        ids, mask = list(segment.token_ids), list(segment.loss_mask)
        logprobs, kept_versions = list(segment.logprobs), list(segment.weight_versions)
        routing = _routing(segment.routing, len(ids), out.routing_shape)
        at = bisect.bisect(rows, ids)
        shared = max((_common_prefix(ids, row) for row in rows[max(at - 1, 0) : at + 1]), default=0)
        room = shared + max_tokens - out.unique_tokens
        if len(ids) > room:
            out.truncated = True
            ids, mask, logprobs, kept_versions = ids[:room], mask[:room], logprobs[:room], kept_versions[:room]
            if routing:  # one row per kept position but the last
                routing = routing[: max(room - 1, 0) * out.routing_shape.bytes_per_position]
        out.unique_tokens += max(len(ids) - shared, 0)
        bisect.insort(rows, ids)
        start = next((i for i, m in enumerate(mask) if m), None)
        if start:  # else no sampled token left, or nothing to condition on: no row
            out.segments.append(
                TrialSegment(
                    prompt_ids=ids[:start],
                    completion_ids=ids[start:],
                    logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:], strict=True)],
                    loss_mask=mask[start:],
                    routing=routing,
                )
            )
            versions += [v for v, m in zip(kept_versions, mask, strict=True) if m and v >= 0]
        if out.truncated:
            break  # the budget ran out here: what the trial did after is not kept
    out.weight_version = min(versions, default=0)
    return out


def _routing(encoded: str, tokens: int, shape: RoutingShape | None) -> bytes:
    """A recorded segment's routing bytes; ContractError unless they are one row of `shape` per token but the last."""
    if not encoded:
        return b""
    try:
        data = base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise ContractError(f"not a recorded trajectory: a segment's routing is not base64 ({exc})") from None
    rows = max(tokens - 1, 0)
    if shape is None or len(data) != rows * shape.bytes_per_position:
        raise ContractError(
            f"not a recorded trajectory: a segment of {tokens} tokens has {len(data)} bytes of routing; it needs "
            f"{rows} rows of the routing_shape ({shape})"
        )
    return data


def metadata_message(weight_version: int, sampled_tokens: int, **fields: Any) -> common_pb2.Trajectory:
    """A trial's Trajectory without token arrays (they are staged): its version, sampled count and `fields`."""
    return common_pb2.Trajectory(weight_version=weight_version, sampled_tokens=sampled_tokens, **fields)


def trajectory_message(tokens: TrialTokens, **fields: Any) -> common_pb2.Trajectory:
    """The trial's tokens as the common Trajectory, with `fields` (its id, verdict, ...) set beside them:
    metadata_message's fields plus the arrays, so the two paths' metadata are the same."""
    first, *later = tokens.segments
    message = common_pb2.Trajectory(
        prompt_token_ids=first.prompt_ids,
        completion_token_ids=first.completion_ids,
        completion_logprobs=first.logprobs,
        completion_loss_mask=first.loss_mask,
        routing=first.routing,
        later_segments=[
            common_pb2.Segment(
                prompt_token_ids=s.prompt_ids,
                completion_token_ids=s.completion_ids,
                completion_logprobs=s.logprobs,
                completion_loss_mask=s.loss_mask,
                routing=s.routing,
            )
            for s in later
        ],
        weight_version=tokens.weight_version,
        sampled_tokens=tokens.sampled_tokens,
        **fields,
    )
    shape = tokens.routing_shape
    if shape is not None and any(s.routing for s in tokens.segments):
        message.routing_shape.CopyFrom(
            common_pb2.RoutingShape(moe_layers=shape.moe_layers, top_k=shape.top_k, num_experts=shape.num_experts)
        )
    return message


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix (a binary search of slice comparisons, which run in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
