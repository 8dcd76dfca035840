"""The rollout's domain results on the wire: completions, their deltas, routing layouts, prefix-cache counters.

Guarantees: a staged completion carries its token count and text but no token arrays (they are in the staged
payload); routing goes out only for a result whose engine captured it, position for position with the tokens.
"""

from __future__ import annotations

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.experience.routing_layout import RoutingShape, to_bytes
from services.rollout.engine import Completion, GenerationResult


def kv_cache_proto(stats) -> rollout_pb2.KvCacheStats | None:
    """An engine's prefix cache counters (PrefixStats) on the wire; None (unset) when it reports none."""
    if stats is None:
        return None
    return rollout_pb2.KvCacheStats(
        capacity_tokens=stats.capacity_tokens,
        live_tokens=stats.live_tokens,
        cached_tokens=stats.cached_tokens,
        cached_entries=stats.cached_entries,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        prefill_tokens_saved=stats.prefill_tokens_saved,
        evictions=stats.evictions,
        pressure=stats.pressure,
    )


def completion_proto(
    completion: Completion, *, staged: bool = False, routing: GenerationResult | None = None
) -> rollout_pb2.Completion:
    """`completion` on the wire; `staged`: its token ids and logprobs are in a staged payload, not here;
    `routing`: the result whose routing goes back (GenerateRequest.return_routing), None: none."""
    message = rollout_pb2.Completion(
        token_ids=() if staged else completion.token_ids,
        logprobs=() if staged else completion.logprobs,
        num_tokens=len(completion.token_ids),
        text=completion.text,
        finish_reason=completion.finish_reason,
        top_logprobs=[
            rollout_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs) for top in completion.top_logprobs
        ],
    )
    shape = routing.routing_shape if routing is not None else None
    if shape is not None and not staged and completion.routing is not None:
        message.routing = to_bytes(completion.routing, shape)
        if completion.prompt_routing is not routing.prompt_routing:
            message.prompt_routing = to_bytes(completion.prompt_routing, shape)
    return message


def routing_shape_proto(shape: RoutingShape) -> common_pb2.RoutingShape:
    return common_pb2.RoutingShape(moe_layers=shape.moe_layers, top_k=shape.top_k, num_experts=shape.num_experts)


def delta_proto(index: int, token_ids: list[int], logprobs: list[float]) -> rollout_pb2.CompletionDelta:
    return rollout_pb2.CompletionDelta(index=index, token_ids=token_ids, logprobs=logprobs)


def merge_into(message: rollout_pb2.GenerateStreamResponse, later: rollout_pb2.GenerateStreamResponse) -> None:
    """`later` appended to `message`, as if one message carried both: each completion's tokens of `message`
    then of `later`, and `later`'s result."""
    by_index = {d.index: d for d in message.deltas}
    for d in later.deltas:
        if (into := by_index.get(d.index)) is None:
            by_index[d.index] = into = message.deltas.add(index=d.index)
        into.token_ids.extend(d.token_ids)
        into.logprobs.extend(d.logprobs)
    if later.HasField("result"):
        message.result.CopyFrom(later.result)
