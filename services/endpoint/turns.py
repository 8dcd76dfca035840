"""One model call of a session: plan the prompt ids, generate on a replica, record the turn, shape the reply.

    Chat ──images? gate_images──> Session.plan | plan_fresh ──> prompt ids ──Backend.complete──> completions
        (a streamed reply: its LiveTurn hears each completion's tokens as they come)
        ──choices_of──> the reply's choices (content, tool calls) + what the session records (Sampled)
    job's policy.generation ──turn_sampling──> the turn's temperature/top_p/top_k (the reply's SAMPLING_HEADER)
    Chat.thinking ──off: an empty block after the generation prompt (context) | a budget: budget.py's two calls

Guarantees: calls of one session run one at a time (the session's lock), from planning to recording;
images pass the job's multimodal gate before any replica is asked (a BadRequest, a 400, otherwise);
a turn is recorded only from a finished reply, so a failed call leaves the session as it was; a
session that already took a turn and loses its replica with none left ends (later calls are
SessionEnded) and leaves the router; a call without a session is served by a one-off session the
store never holds, so it is not recorded anywhere. Every turn samples under the job's law
(turn_sampling, the one home of that rule), whatever the client asked, and the reply says which;
a session opened greedy (POST /v1/sessions with the service token's greedy header: a validation
trial's) has every turn greedy, whoever makes the call. A job whose model reasons (reasoning.py) has
each reply's thinking block split off as its reasoning (tool calls are parsed from what follows it);
thinking off writes the template's empty block after the generation prompt as context (the turn's
`prefill`), a budget is budget.py's; a budget asked of a model that does not reason, or with images,
is a BadRequest. A long prompt's planning and a long reply's parsing run in a worker thread, never on
the event loop that carries every call's stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dockyard.agents.tool_formats import parse, visible_text
from dockyard.api.common.v1 import common_pb2
from dockyard.images import ImageRejected, gate_images
from services.endpoint import reasoning
from services.endpoint.backend import Backend, GenerateRefused, JobModel, Prompted, ReplicaLost
from services.endpoint.budget import Reply, complete_budgeted
from services.endpoint.convert import Chat, Choice, reply_message
from services.endpoint.errors import BadRequest
from services.endpoint.reasoning import without_reasoning
from services.endpoint.sessions import Sampled, Session, SessionStore
from services.endpoint.streaming import LiveTurn

# Measured on character tokenizers (a token a character): a prompt's render and encode take about 0.6 µs a
# character (1.1 ms for 1,872), a reply's decode and parse about 5 µs a token; a hop to a worker thread and
# back took 1.5 to 2.2 ms (median) on a busy 2-core machine (bench/endpoint.py). So work of about a
# millisecond runs on the event loop, and longer work (a long history, a long reply) in a thread, where it
# cannot hold up the other calls' streams.
INLINE_PROMPT_CHARS = 2_000
INLINE_REPLY_TOKENS = 200


async def _run(small: bool, fn, *args):
    """fn(*args) on the event loop when `small`, else in a worker thread."""
    return fn(*args) if small else await asyncio.to_thread(fn, *args)


@dataclass(frozen=True)
class TurnSampling:
    """The sampling law a turn is drawn under (top_k 0 = off), as the reply's SAMPLING_HEADER states it."""

    temperature: float
    top_p: float
    top_k: int

    def header(self) -> str:
        return f"temperature={self.temperature:g} top_p={self.top_p:g} top_k={self.top_k}"


def turn_sampling(job: JobModel, greedy: bool = False) -> TurnSampling:
    """Which sampling settings a turn uses: the job's policy.generation temperature, top_p and top_k.

    The client's values (OpenAI temperature/top_p, vLLM's top_k in `extra_body`, Anthropic
    temperature/top_p/top_k) never count: the trainer recomputes logprobs at the job's temperature,
    so a turn sampled under any other law would train with wrong importance ratios, silently.
    `greedy` is a validation call's (the service token's SAMPLING_HEADER: greedy): temperature 0,
    and its tokens are never trained. A job served without generation settings is refused rather
    than sampled under a law the trainer does not know.
    """
    law = job.sampling
    if law is None:
        raise GenerateRefused(
            f"model {job.job_id!r} has no policy.generation settings: the endpoint cannot sample under the "
            "law the trainer assumes"
        )
    return TurnSampling(0.0 if greedy else law.temperature, law.top_p, law.top_k)


@dataclass
class Served:
    """A call's reply: its choices, the OpenAI-style token usage, and the sampling law it was drawn under."""

    choices: list[Choice]
    usage: dict[str, int]
    sampling: TurnSampling


async def take_turn(
    backend: Backend,
    store: SessionStore,
    model_id: str,
    chat: Chat,
    session_id: str | None,
    create: bool = True,
    greedy: bool = False,
    live: LiveTurn | None = None,
) -> Served:
    """Serve one call of `session_id` (None: not recorded) with the job `model_id`'s current policy, under
    the job's sampling law (greedy: a validation call's, or the session was opened greedy); a session not
    held is opened only with `create` (else UnknownSession). With `live` (a streamed reply) the law and
    the prompt's size are told before generating and the tokens as they are sampled; the turn is recorded
    from the finished completion all the same, and a turn cancelled before it finished records nothing."""
    job = await backend.model(model_id)
    session = store.open(session_id, create, greedy) if session_id else Session("", store.max_turns, 0.0)
    # A session opened greedy (validation) stays greedy whoever calls: a scaffold's key cannot undo it.
    law = turn_sampling(job, greedy or session.greedy)
    chat.thinking.check(job.reasoning)
    params = sampling_params(chat, job, law)
    budget = chat.thinking.tokens(params.max_new_tokens) if job.reasoning else None
    if budget is not None and budget >= params.max_new_tokens:
        budget = None  # the reply's own limit is the tighter one
    if budget is not None and chat.images:
        raise BadRequest(f"{chat.thinking.field}: a thinking budget with images is not supported")
    images = None
    if chat.images:  # the job's multimodal gate, before any replica is asked
        try:
            await asyncio.to_thread(gate_images, chat.images, job.images)
        except ImageRejected as exc:
            raise BadRequest(str(exc)) from None
    short = not chat.images and len(repr(chat.messages)) + len(repr(chat.tools)) < INLINE_PROMPT_CHARS
    async with session.lock:
        if chat.images:
            plan = await asyncio.to_thread(session.plan_fresh, job.renderer, chat.messages, chat.tools, "images")
        else:
            plan = await _run(short, session.plan, job.renderer, chat.messages, chat.tools)
        prefill = await _run(short, no_thinking, job, chat) if chat.thinking.off and job.reasoning else ""
        if prefill:
            plan.prefilled(job.renderer.encode(prefill))
        if chat.images:
            images = Prompted(plan.prompt_text_tail + prefill, chat.images)
        opened = job.reasoning and reasoning.opens_block(plan.prompt_text_tail + prefill)
        on_tokens = None
        if live is not None:
            thinking = opened if job.reasoning else None
            whole = budget is not None or bool(chat.top_logprobs)
            live.start(law, len(plan.prompt_ids), job.renderer, job.parser, chat, thinking, whole)
            on_tokens = live.tokens
        try:
            if budget is None:
                generated = await backend.complete(
                    model_id,
                    session_id,
                    plan.prompt_ids,
                    chat.n,
                    params,
                    images,
                    on_tokens,
                    top_logprobs=chat.top_logprobs,
                    routing=job.routing,
                )
                replies = [Reply.sampled(c) for c in generated.completions]
            else:
                generated, replies = await complete_budgeted(
                    backend,
                    model_id,
                    session_id,
                    plan.prompt_ids,
                    chat.n,
                    params,
                    budget,
                    job.renderer,
                    opened,
                    top_logprobs=chat.top_logprobs,
                    routing=job.routing,
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
            longest = max(len(c.token_ids) for c in replies)
            backend.router.note_size(session_id, len(plan.prompt_ids) + longest)
        short = sum(len(r.token_ids) for r in replies) < INLINE_REPLY_TOKENS
        choices, sampled = await _run(short, choices_of, job, chat, plan.prompt_text_tail, replies, opened)
        versions = sorted({*generated.weight_versions, *(v for r in replies for v in r.versions if v >= 0)})
        session.record(
            plan, sampled, generated.weight_version, versions, generated.prompt_routing, generated.routing_shape
        )
    usage = {
        "prompt_tokens": len(plan.prompt_ids),
        "completion_tokens": sum(len(r.token_ids) - len(r.forced) for r in replies),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return Served(choices, usage, law)


async def prompt_tokens(backend: Backend, model_id: str, chat: Chat) -> int:
    """How many tokens `chat` is as a prompt of the job `model_id`: its template's rendering with the
    generation prompt, as a session's first call would send it."""
    if chat.images:
        raise BadRequest("counting tokens of images is not supported: the replica's processor expands them")
    renderer = (await backend.model(model_id)).renderer
    return await asyncio.to_thread(lambda: len(renderer.encode(renderer.render(chat.messages, chat.tools, True))))


def no_thinking(job: JobModel, chat: Chat) -> str:
    """What follows the generation prompt so the model answers without thinking (reasoning.no_thinking)."""
    renderer, messages = job.renderer, without_reasoning(chat.messages)

    def render(**switches) -> str:
        return renderer.render(messages, chat.tools, True, **switches)

    return reasoning.no_thinking(render, render(), "enable_thinking" in str(renderer.tokenizer.chat_template))


def sampling_params(chat: Chat, job: JobModel, law: TurnSampling) -> common_pb2.SamplingParams:
    """The call's sampling as Generate takes it: the turn's law, and the client's length, stops and seed
    (no max_tokens is the job's max_new_tokens)."""
    return common_pb2.SamplingParams(
        temperature=law.temperature,
        top_p=law.top_p,
        top_k=law.top_k,
        max_new_tokens=chat.max_tokens or job.max_new_tokens,
        stop=chat.stop,
        seed=chat.seed,
        ignore_eos=chat.ignore_eos,
    )


def made_required_call(chat: Chat, calls: list[dict]) -> bool:
    """Whether the reply made the call `tool_choice` required (`required`/`any`: some call; a named tool: a
    call of it); a reply that did not is returned as it is and recorded as an invalid action."""
    if chat.required_call is None:
        return True
    if not calls:
        return False
    return not chat.required_call or all(c["function"]["name"] == chat.required_call for c in calls)


def choices_of(
    job: JobModel, chat: Chat, prompt_tail: str, replies: list[Reply], opened: bool = False
) -> tuple[list[Choice], list[Sampled]]:
    """Each completion as returned (reasoning split off, content, parsed tool calls, stop string removed) and
    as recorded (`opened`: the prompt ends inside a thinking block)."""
    tokenizer = job.renderer.tokenizer
    choices, sampled = [], []
    for c in replies:
        ids = list(c.token_ids)
        text = visible_text(job.parser, tokenizer, ids)
        stop = next((s for s in chat.stop if c.finish_reason == "stop" and text.endswith(s)), None)
        if stop is not None:
            text = text[: -len(stop)]
        thought, text = reasoning.split(text, opened) if job.reasoning else (None, text)
        parsed = parse(job.parser, text, chat.tools, tokenizer, prompt_tail)
        pieces = job.renderer.decode_each(ids)
        choice = Choice(
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            finish_reason=c.finish_reason,
            stop=stop,
            tokens=pieces,
            logprobs=list(c.logprobs),
            top_logprobs=[list(zip(job.renderer.decode_each(alt), lps, strict=True)) for alt, lps in c.top_logprobs],
            reasoning=thought,
            reasoning_tokens=reasoning.count(pieces, opened) if thought is not None else 0,
        )
        choices.append(choice)
        decoded = job.renderer.decode(ids)
        unclosed = not reasoning.closed(decoded, opened)
        malformed = parsed.malformed or unclosed or not made_required_call(chat, parsed.tool_calls)
        message = reply_message(choice)
        sampled.append(
            Sampled(
                ids,
                list(c.logprobs),
                decoded,
                c.finish_reason,
                message,
                malformed,
                c.forced,
                c.versions,
                c.routing,
                c.prompt_routing,
            )
        )
    return choices, sampled
