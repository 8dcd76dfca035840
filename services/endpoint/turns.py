"""One model call of a session: plan the prompt ids, generate on a replica, record the turn, shape the reply.

    Chat ──images? gate_images──> Session.plan | plan_fresh ──> prompt ids ──Backend.complete──> completions
        ──choices_of──> the reply's choices (content, tool calls) + what the session records (Sampled)

Guarantees: calls of one session run one at a time (the session's lock), from planning to recording;
images pass the job's multimodal gate before any replica is asked (a BadRequest, a 400, otherwise);
a turn is recorded only from a finished reply, so a failed call leaves the session as it was; a
session that already took a turn and loses its replica with none left ends (later calls are
SessionEnded) and leaves the router; a call without a session is served by a one-off session the
store never holds, so it is not recorded anywhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dockyard.algorithms.malformed import unclosed_thinking
from dockyard.api.common.v1 import common_pb2
from dockyard.images import ImageRejected, gate_images
from services.endpoint.backend import Backend, JobModel, Prompted, ReplicaLost
from services.endpoint.convert import BadRequest, Chat, Choice, reply_message
from services.endpoint.sessions import Sampled, Session, SessionStore
from services.endpoint.tool_parsers import parse


@dataclass
class Served:
    """A call's reply: its choices, and the OpenAI-style token usage."""

    choices: list[Choice]
    usage: dict[str, int]


async def take_turn(
    backend: Backend, store: SessionStore, model_id: str, chat: Chat, session_id: str | None, create: bool = True
) -> Served:
    """Serve one call of `session_id` (None: not recorded) with the job `model_id`'s current policy; a
    session not held is opened only with `create` (else UnknownSession)."""
    job = await backend.model(model_id)
    session = store.open(session_id, create) if session_id else Session("", store.max_turns, 0.0)
    images = None
    if chat.images:  # the job's multimodal gate, before any replica is asked
        try:
            await asyncio.to_thread(gate_images, chat.images, job.images)
        except ImageRejected as exc:
            raise BadRequest(str(exc)) from None
    async with session.lock:
        if chat.images:
            plan = await asyncio.to_thread(session.plan_fresh, job.renderer, chat.messages, chat.tools, "images")
            images = Prompted(plan.prompt_text_tail, chat.images)
        else:
            plan = await asyncio.to_thread(session.plan, job.renderer, chat.messages, chat.tools)
        try:
            generated = await backend.complete(
                model_id, session_id, plan.prompt_ids, chat.n, sampling_params(chat, job), images
            )
        except ReplicaLost as exc:
            if session.turns:  # mid-session and no replica to go on with: the trial ends
                session.ended = str(exc)
                backend.router.release(session.id)
            raise
        session.replica = generated.replica
        if images is not None:  # the ids the model saw, image tokens included
            plan.prompt_ids = generated.prompt_token_ids
        if session_id:
            longest = max(len(c.token_ids) for c in generated.completions)
            backend.router.note_size(session_id, len(plan.prompt_ids) + longest)
        choices, sampled = await asyncio.to_thread(choices_of, job, chat, plan.prompt_text_tail, generated.completions)
        session.record(plan, sampled, generated.weight_version, generated.weight_versions)
    usage = {
        "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": sum(len(c.token_ids) for c in generated.completions),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return Served(choices, usage)


def sampling_params(chat: Chat, job: JobModel) -> common_pb2.SamplingParams:
    """The call's sampling as Generate takes it; no max_tokens is the job's max_new_tokens."""
    return common_pb2.SamplingParams(
        temperature=chat.temperature,
        top_p=chat.top_p,
        top_k=chat.top_k,
        max_new_tokens=chat.max_tokens or job.max_new_tokens,
        stop=chat.stop,
        seed=chat.seed,
        ignore_eos=chat.ignore_eos,
    )


def choices_of(job: JobModel, chat: Chat, prompt_tail: str, completions) -> tuple[list[Choice], list[Sampled]]:
    """Each completion as returned (content, parsed tool calls, stop string removed) and as recorded."""
    tokenizer = job.renderer.tokenizer
    choices, sampled = [], []
    for c in completions:
        ids = list(c.token_ids)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop = next((s for s in chat.stop if c.finish_reason == "stop" and text.endswith(s)), None)
        if stop is not None:
            text = text[: -len(stop)]
        parsed = parse(job.parser, text, chat.tools, tokenizer, prompt_tail)
        choice = Choice(
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            finish_reason=c.finish_reason,
            stop=stop,
            tokens=job.renderer.decode_each(ids),
            logprobs=list(c.logprobs),
        )
        choices.append(choice)
        decoded = job.renderer.decode(ids)
        malformed = parsed.malformed or unclosed_thinking(decoded)
        sampled.append(Sampled(ids, list(c.logprobs), decoded, c.finish_reason, reply_message(choice), malformed))
    return choices, sampled
