"""What a session's trajectory trains: the kept path of each segment's turn tree, as the contract's segments.

    Segment (a tree of turns: each extends a `parent` by its reply, its context or its prompt again)
        ──kept path: from the segment's latest turn up through the parents──> token_ids, loss_mask, ...
        ──every other completion──> abandoned {retry, dropped, unchosen, branch}, kept only in `turns`

Guarantees:
- A segment's token row is the history its latest turn was sampled in plus that turn's chosen
  completion (the first, as a client's `choices[0]`): each turn on the way contributes its prompt and,
  where the next turn went on after one of its replies, that reply's sampled ids (loss mask 1, with
  their logprobs and weight version). Nothing else is in the row, so every trained token is a reply
  the scaffold built on, in exactly the context it was sampled in; tokens of a reply the endpoint
  wrote itself (`forced`: a thinking budget's closing tag) are in the row as context (loss mask 0).
- Every other completion is abandoned, counted by why: `retry` (the same prompt was sent again),
  `dropped` (the next prompt went on from the reply's context without it), `unchosen` (another choice
  of an n > 1 turn was taken), `branch` (the scaffold went back to an earlier point). Abandoned
  completions stay listed in their turn (`trained` false, `abandoned` saying why) and in no row.
- Routing (with a routing shape): a segment's `routing` holds one row per kept position but the last,
  each the row of the first turn on the kept path that ran that position (its prefill, or its prefix
  cache's row, and its sampled tokens), so it is aligned with `token_ids` position by position. A
  segment one of whose kept turns returned no routing carries none ("").
- Invalid actions: each trained completion that is malformed, plus each turn whose reply was dropped
  (the scaffold refused it as an action: mini-swe-agent's format error).
"""

from __future__ import annotations

import base64
from collections import Counter
from typing import Any

from dockyard.agents import contract
from dockyard.agents.contract import ABANDONED_REASONS
from dockyard.experience.routing_layout import RoutingShape

# sessions.Segment, which imports this module (so it is not imported here).
Segment = Any


def segments(
    recorded: list[Segment], routing_shape: RoutingShape | None = None
) -> tuple[list[contract.Segment], dict[str, int], int]:
    """(the contract's segments, abandoned completions by why, invalid actions) of a session's segments."""
    out, abandoned, invalid = [], Counter[str](), 0
    per = routing_shape.bytes_per_position if routing_shape is not None else 0
    for segment in recorded:
        document, left, bad = _segment(segment, per)
        out.append(document)
        abandoned.update(left)
        invalid += bad
    return out, {why: abandoned[why] for why in ABANDONED_REASONS if abandoned[why]}, invalid


def _path(segment: Segment) -> dict[int, tuple[str, int]]:
    """Turn index -> how the kept path uses it: ("reply", choice), ("context", 0) or ("retry", 0)."""
    leaf = len(segment.turns) - 1
    path = {leaf: ("reply", 0)}
    child = segment.turns[leaf]
    while child.parent >= 0:
        path[child.parent] = (child.extends, child.parent_choice)
        child = segment.turns[child.parent]
    return path


def _segment(segment: Segment, per: int) -> tuple[contract.Segment, Counter[str], int]:
    path = _path(segment) if segment.turns else {}
    # Why each turn off the kept path, or whose reply the path does not take, was left.
    left_as = {i: {"retry": "retry", "context": "dropped"}.get(use, "") for i, (use, _) in path.items()}
    for turn in segment.turns:
        if turn.parent >= 0 and turn.parent not in path and turn.extends in ("retry", "context"):
            left_as[turn.parent] = "retry" if turn.extends == "retry" else "dropped"
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    routing = bytearray()  # one row per kept position run so far (per bytes each)
    routed = per > 0
    abandoned: Counter[str] = Counter()
    invalid = 0
    turns = []
    for i, turn in enumerate(segment.turns):
        use, choice = path.get(i, ("", 0))
        why = left_as.get(i) or ("branch" if i not in path else "")
        trained = use == "reply"
        if trained:
            # The path's turns come in order and each prompt extends the row so far: its new part is context.
            assert turn.prompt_ids[: len(ids)] == ids, "a kept turn's prompt does not extend the kept path"
            new = turn.prompt_ids[len(ids) :]
            ids += new
            mask += [0] * len(new)
            logprobs += [0.0] * len(new)
            versions += [-1] * len(new)
            sampled = turn.completions[choice]
            if routed:
                # Rows this turn holds from routing_from on; those the path already has are an earlier turn's.
                rows = sampled.prompt_routing or turn.prompt_routing
                skip = len(routing) // per - turn.routing_from
                routed = bool(rows) and skip >= 0
                routing += rows[skip * per :] + sampled.routing
            forced = set(sampled.forced)
            ids += sampled.token_ids
            mask += [int(k not in forced) for k in range(len(sampled.token_ids))]
            logprobs += sampled.logprobs
            versions += sampled.versions or [turn.weight_version] * len(sampled.token_ids)
            invalid += sampled.malformed
            abandoned["unchosen"] += len(turn.completions) - 1
        else:
            abandoned[why] += len(turn.completions)
            invalid += why == "dropped"
        turns.append(
            contract.Turn(
                prompt_token_ids=turn.prompt_ids,
                weight_version=turn.weight_version,
                weight_versions=turn.weight_versions,
                chosen=choice,
                completions=[
                    contract.Completion(
                        token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason, forced=c.forced
                    )
                    for c in turn.completions
                ],
                parent=turn.parent,
                extends=turn.extends,
                trained=trained,
                abandoned="" if trained else why,
            )
        )
    last = segment.turns[-1] if segment.turns else None
    document = contract.Segment(
        reason=segment.reason,
        # The last call's messages and the reply it kept.
        messages=[*segment.messages, *([last.completions[0].message] if last else [])],
        tools=segment.tools,
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        weight_versions=versions,
        turns=turns,
    )
    if routed and len(routing) >= (need := max(len(ids) - 1, 0) * per):
        document.routing = base64.b64encode(bytes(routing[:need])).decode()
    return document, abandoned, invalid
