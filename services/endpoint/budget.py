"""A reply under a thinking budget: reasoning of at most N sampled tokens, then the answer.

    prompt ──Generate(max N, stop </think>)──> s1 ──closed?──────────────────────────> Generate(prompt+s1) ──> s2
                                                 └─ran out, block open: + "\n</think>\n\n" (forced, context) ─┘
    reply = s1 + forced + s2: s1 and s2 sampled (trained), forced written by the endpoint (loss mask 0)

Guarantees: every token of a reply that the policy did not sample is listed in `forced` (and has
logprob 0.0, weight version -1 and no top_logprobs alternatives), so the recorder trains it as context,
never as an action; s2 is
sampled in exactly the context recorded before it (the prompt, s1 and the forced tag); a first call
that ends the reply itself (eos, or a stop string of the request's) is the whole reply; the budget
and the answer share the reply's token limit (forced tokens do not count against it). With routing,
the reply's rows are s1's, then the second call's prompt rows from where s1's end (s1's last token and
the forced tag, routed by its prefill), then s2's: one row per reply position but the last, as a
single call's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dockyard.api.common.v1 import common_pb2
from dockyard.config.sampling import MAX_STOP_STRINGS
from services.endpoint.backend import Backend, Generated
from services.endpoint.errors import BadRequest
from services.endpoint.reasoning import CLOSE, OPEN, closed
from services.endpoint.rendering import Renderer

# What the endpoint writes when the budget ran out inside the block (Qwen3's way of closing it).
FORCED_CLOSE = f"\n{CLOSE}\n\n"


@dataclass
class Reply:
    """One completion of a turn as recorded: its ids, logprobs and finish, and which ids the endpoint forced."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    forced: list[int] = field(default_factory=list)  # positions in token_ids
    versions: list[int] = field(default_factory=list)  # per token; empty: the turn's weight version
    # Per token when top_logprobs was asked: its step's (token ids, logprobs); a forced id has none.
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # With routing: the rows of token_ids' positions but the last, and the completion's own prompt rows where
    # its prompt was routed otherwise than the call's (Completion.prompt_routing; b"": the call's).
    routing: bytes = b""
    prompt_routing: bytes = b""

    @classmethod
    def sampled(cls, completion) -> Reply:
        tops = [(list(top.token_ids), list(top.logprobs)) for top in completion.top_logprobs]
        return cls(
            list(completion.token_ids),
            list(completion.logprobs),
            completion.finish_reason,
            top_logprobs=tops,
            routing=completion.routing,
            prompt_routing=completion.prompt_routing,
        )


def _params(params: common_pb2.SamplingParams, **changes) -> common_pb2.SamplingParams:
    copy = common_pb2.SamplingParams()
    copy.CopyFrom(params)
    for key, value in changes.items():
        if key == "stop":
            copy.stop[:] = value
        else:
            setattr(copy, key, value)
    return copy


async def complete_budgeted(
    backend: Backend,
    model_id: str,
    session_id: str | None,
    prompt_ids: list[int],
    n: int,
    params: common_pb2.SamplingParams,
    budget: int,
    renderer: Renderer,
    opened: bool,
    *,
    top_logprobs: int = 0,
    routing: bool = False,
) -> tuple[Generated, list[Reply]]:
    """The first call's Generated (its replica and weight version) and each completion as a Reply (both calls
    ask Generate for `top_logprobs` alternatives per sampled token)."""
    if len(params.stop) >= MAX_STOP_STRINGS:
        most = MAX_STOP_STRINGS - 1
        raise BadRequest(f"stop: a thinking budget needs one stop string of its own; send at most {most}")
    first = _params(params, max_new_tokens=budget, stop=[*params.stop, CLOSE])
    generated = await backend.complete(
        model_id, session_id, prompt_ids, n, first, top_logprobs=top_logprobs, routing=routing
    )

    async def finish(completion) -> Reply:
        reply = Reply.sampled(completion)
        reply.versions = [generated.weight_version] * len(reply.token_ids)
        text = renderer.decode(reply.token_ids)
        ended = completion.finish_reason == "eos" or (completion.finish_reason == "stop" and CLOSE not in text)
        left = params.max_new_tokens - len(reply.token_ids)
        if ended or left <= 0:
            return reply
        open_block = opened or text.lstrip().startswith(OPEN)
        forced = renderer.encode(FORCED_CLOSE) if open_block and not closed(text, opened) else []
        more = await backend.complete(
            model_id,
            session_id,
            [*prompt_ids, *reply.token_ids, *forced],
            1,
            _params(params, max_new_tokens=left),
            top_logprobs=top_logprobs,
            routing=routing,
        )
        answer = more.completions[0]
        if routing and more.routing_shape is not None:
            per = more.routing_shape.bytes_per_position
            ran = len(prompt_ids) + len(reply.routing) // per  # positions with a row so far
            reply.routing += (answer.prompt_routing or more.prompt_routing)[ran * per :] + answer.routing
        else:
            reply.routing = b""
        start = len(reply.token_ids)
        reply.token_ids += [*forced, *answer.token_ids]
        reply.logprobs += [0.0] * len(forced) + list(answer.logprobs)
        reply.versions += [-1] * len(forced) + [more.weight_version] * len(answer.token_ids)
        reply.forced = list(range(start, start + len(forced)))
        if top_logprobs:  # a forced id was not sampled: no alternatives
            reply.top_logprobs += [([], [])] * len(forced) + Reply.sampled(answer).top_logprobs
        reply.finish_reason = answer.finish_reason
        return reply

    return generated, list(await asyncio.gather(*(finish(c) for c in generated.completions)))
