"""An endpoint session's recorded trajectory as the common Trajectory's token fields.

    GET /v1/sessions/{id}/trajectory ──> segments[(token_ids, loss_mask, logprobs, weight_versions)]
        ──trial_tokens──> first segment: prompt = tokens before the first sampled one, completion = the rest
                          later segments: the same, each on its own

Guarantees: token ids, the loss mask (1 exactly on sampled tokens) and the sampled tokens' logprobs
are taken as the endpoint recorded them, never re-tokenized; context tokens get logprob 0.0; the
whole trajectory is cut to at most `max_tokens` tokens over its segments (a segment that would start
past the cut is dropped, one left with no sampled token is dropped), so what the trainer gets fits the
trial's budget; the weight version is the oldest that sampled any kept token. A recording is read
through the contract's models (dockyard/agents/contract.py): one that does not fit is a ContractError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dockyard.agents.contract import RecordedTokens, TrajectoryDocument


@dataclass
class TrialSegment:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]


@dataclass
class TrialTokens:
    segments: list[TrialSegment] = field(default_factory=list)
    weight_version: int = 0
    truncated: bool = False

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)

    @property
    def total_tokens(self) -> int:
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in self.segments)


def trial_tokens(recorded: TrajectoryDocument | RecordedTokens | dict[str, Any], max_tokens: int) -> TrialTokens:
    """The segments of a recorded session (a document, or its decoded JSON), cut to `max_tokens` tokens in all."""
    if isinstance(recorded, dict):
        recorded = RecordedTokens.parse(recorded)
    out = TrialTokens()
    left = max_tokens
    versions: list[int] = []
    for segment in recorded.segments:
        if left <= 0:
            out.truncated = True
            break
        ids, mask = list(segment.token_ids), list(segment.loss_mask)
        logprobs, kept_versions = list(segment.logprobs), list(segment.weight_versions)
        if len(ids) > left:
            out.truncated = True
            ids, mask, logprobs, kept_versions = ids[:left], mask[:left], logprobs[:left], kept_versions[:left]
        left -= len(ids)
        start = next((i for i, m in enumerate(mask) if m), None)
        if not start:  # no sampled token left, or nothing to condition on
            continue
        out.segments.append(
            TrialSegment(
                prompt_ids=ids[:start],
                completion_ids=ids[start:],
                logprobs=[lp if m else 0.0 for lp, m in zip(logprobs[start:], mask[start:], strict=True)],
                loss_mask=mask[start:],
            )
        )
        versions += [v for v, m in zip(kept_versions, mask, strict=True) if m and v >= 0]
    out.weight_version = min(versions, default=0)
    return out
