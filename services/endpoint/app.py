"""The policy endpoint's HTTP API (FastAPI): OpenAI chat completions, Anthropic messages, models, sessions.

    POST /v1/chat/completions   OpenAI Chat Completions (tools, n, logprobs, stream)
    POST /v1/messages           Anthropic Messages (system, tool_use / tool_result, stream)
    GET  /v1/models             running jobs (a model id is a job id)
    POST /v1/sessions           a new session id and its session-scoped API key
    GET  /v1/sessions/{id}/trajectory, DELETE /v1/sessions/{id}
    GET  /v1/routing            sessions, admission queue and KV pressure per replica
    GET  /health                liveness, no auth

Guarantees: with DOCKYARD_AUTH_TOKEN set, every /v1 route needs the token or a
session key (`Authorization: Bearer` or `x-api-key`), else 401. A call's
session is its `X-Dockyard-Session` header, else its session key's; the reply
names it in `X-Dockyard-Session`. A call with neither is served but not
recorded (nothing could continue it). Calls of one session run
one at a time. Image parts pass the job's multimodal gate (dockyard/images.py) before any replica
is asked: off, over its limits or unreadable is a 400 naming the key or the numbers; a turn with
images is rendered afresh as its own segment, and the ids the rollout reports (image tokens
included) are what the trajectory records. Errors are JSON `{"type": "error", "error": {"type", "message"}}`
(readable by both official clients): malformed JSON 400, a body that does not
fit the schema 422 naming the field, a body over max_body_bytes 413, unknown
model 404, too many sessions or turns 429, a new session refused admission 503
(the queue is full or it waited too long: the agent's trial is lost, not scored), no replica left 503 (a session that
already took a turn then ends as an infrastructure error: its trajectory says
so and later calls get 409; a session whose replica failed goes on on another
one when there is one). No request error stops the endpoint serving other sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from dockyard.algorithms.malformed import unclosed_thinking
from dockyard.api.common.v1 import common_pb2
from dockyard.images import ImageRejected, gate_images
from services.endpoint.backend import Backend, GenerateRefused, JobModel, Prompted, ReplicaLost, UnknownModel
from services.endpoint.convert import (
    BadRequest,
    Chat,
    Choice,
    anthropic_events,
    anthropic_reply,
    from_anthropic,
    from_openai,
    openai_chunks,
    openai_reply,
    reply_message,
)
from services.endpoint.routing import AdmissionRefused, Router
from services.endpoint.schemas import ChatCompletionRequest, MessagesRequest
from services.endpoint.sessions import Sampled, Session, SessionEnded, SessionLimit, SessionStore
from services.endpoint.settings import EndpointSettings
from services.endpoint.tool_parsers import parse

SESSION_HEADER = "X-Dockyard-Session"
_SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_KEY = re.compile(r"^dys-([A-Za-z0-9._:-]{1,128})-([0-9a-f]{32})$")


class Unauthorized(Exception):
    pass


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413 before any of it is parsed."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error(413, "request_too_large", f"the body is over {self.limit} bytes")(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"the body is over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def session_key(token: str, session_id: str) -> str:
    signature = hmac.new(token.encode(), session_id.encode(), hashlib.sha256).hexdigest()[:32]
    return f"dys-{session_id}-{signature}"


def create_app(settings: EndpointSettings, token: str | None, backend: Backend | None = None) -> FastAPI:
    store = SessionStore(
        settings.max_sessions,
        settings.session_idle_seconds,
        settings.max_turns_per_session,
        on_drop=lambda session_id: app.state.backend.router.release(session_id),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # gRPC channels belong to the event loop that serves: made here, not when the app is built.
        if app.state.backend is None:
            app.state.backend = Backend(
                settings.coordinator_address,
                tool_parser=settings.tool_parser,
                generate_timeout=settings.generate_timeout_seconds,
                run_root=settings.run_root,
                router=Router(
                    settings.admission_pressure,
                    settings.admission_queue_size,
                    settings.admission_wait_seconds,
                    settings.admission_session_tokens,
                ),
            )
        yield
        await app.state.backend.close()

    app = FastAPI(title="dockyard policy endpoint", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.store, app.state.backend = store, backend
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    def credentials(request: Request) -> str | None:
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return given

    def authorize(request: Request) -> str | None:
        """The session id the credentials carry (None for the service token); Unauthorized if they fail."""
        given = credentials(request)
        if given and (match := _KEY.match(given)):
            if hmac.compare_digest(given, session_key(token or "", match.group(1))):
                return match.group(1)
        if token and not (given and hmac.compare_digest(given.encode(), token.encode())):
            raise Unauthorized("missing or wrong token: send Authorization: Bearer <token> or x-api-key")
        return None

    def session_of(request: Request) -> str | None:
        from_key = authorize(request)
        header = request.headers.get(SESSION_HEADER)
        if header is not None and not _SESSION_ID.match(header):
            raise BadRequest(f"{SESSION_HEADER} must match {_SESSION_ID.pattern}")
        return header or from_key

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error(400, "invalid_request_error", f"the body is not valid JSON: {errors[0].get('msg')}")
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(422, "invalid_request_error", f"{where or 'body'}: {first.get('msg', 'invalid')}")

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
        return _error(exc.status_code, kind, str(exc.detail))

    for kind, status, name in (
        (Unauthorized, 401, "authentication_error"),
        (BadRequest, 400, "invalid_request_error"),
        (GenerateRefused, 400, "invalid_request_error"),
        (UnknownModel, 404, "not_found_error"),
        (SessionLimit, 429, "rate_limit_error"),
        (AdmissionRefused, 503, "overloaded_error"),
        (SessionEnded, 409, "infrastructure_error"),
        (ReplicaLost, 503, "infrastructure_error"),
    ):

        async def handler(_, exc, status=status, name=name):
            return _error(status, name, str(exc))

        app.add_exception_handler(kind, handler)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return _error(500, "api_error", f"{type(exc).__name__}: {exc}"[:2000])

    async def complete(model_id: str, chat: Chat, session_id: str | None) -> tuple[JobModel, list[Choice], dict]:
        backend = app.state.backend
        job = await backend.model(model_id)
        # A call without a session is served by a one-off session the store never holds.
        session = store.open(session_id) if session_id else Session("", settings.max_turns_per_session, 0.0)
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
            sampling = common_pb2.SamplingParams(
                temperature=chat.temperature,
                top_p=chat.top_p,
                top_k=chat.top_k,
                max_new_tokens=chat.max_tokens or job.max_new_tokens,
                stop=chat.stop,
                seed=chat.seed,
                ignore_eos=chat.ignore_eos,
            )
            try:
                generated = await backend.complete(model_id, session_id, plan.prompt_ids, chat.n, sampling, images)
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
            choices, sampled = await asyncio.to_thread(
                _choices, job, chat, plan.prompt_text_tail, generated.completions
            )
            session.record(plan, sampled, generated.weight_version, generated.weight_versions)
        usage = {
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": sum(len(c.token_ids) for c in generated.completions),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return job, choices, usage

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(store)}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        jobs = await app.state.backend.running_jobs()
        data = [
            {"id": j.job_id, "object": "model", "created": j.create_time.seconds, "owned_by": "dockyard"} for j in jobs
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        session_id = session_of(request)
        _, choices, usage = await complete(body.model, from_openai(body), session_id)
        headers = {SESSION_HEADER: session_id} if session_id else {}
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = openai_chunks(body.model, choices, usage, body.logprobs, with_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(openai_reply(body.model, choices, usage, body.logprobs), headers=headers)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        session_id = session_of(request)
        _, choices, usage = await complete(body.model, from_anthropic(body), session_id)
        headers = {SESSION_HEADER: session_id} if session_id else {}
        if body.stream:
            stream = anthropic_events(body.model, choices[0], usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(anthropic_reply(body.model, choices[0], usage), headers=headers)

    @app.get("/v1/routing")
    async def routing(request: Request):
        authorize(request)
        return app.state.backend.router.snapshot()

    @app.post("/v1/sessions")
    async def new_session(request: Request):
        if authorize(request) is not None:
            raise Unauthorized("a session key cannot open other sessions; use the service token")
        session_id = f"s-{uuid.uuid4().hex}"
        return {"session_id": session_id, "api_key": session_key(token or "", session_id)}

    @app.get("/v1/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str, request: Request):
        own = authorize(request)
        session = store.get(session_id) if own in (None, session_id) else None
        if session is None:
            raise HTTPException(404, f"no session {session_id!r}")
        return session.trajectory()

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, request: Request):
        own = authorize(request)
        if own not in (None, session_id) or not store.delete(session_id):
            raise HTTPException(404, f"no session {session_id!r}")
        app.state.backend.router.release(session_id)
        return {"deleted": session_id}

    return app


def _choices(job: JobModel, chat: Chat, prompt_tail: str, completions) -> tuple[list[Choice], list[Sampled]]:
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
