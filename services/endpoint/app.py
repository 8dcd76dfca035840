"""The policy endpoint's HTTP API (FastAPI): OpenAI chat completions, Anthropic messages, models, sessions.

    POST /v1/chat/completions   OpenAI Chat Completions (tools, n, logprobs, stream)
    POST /v1/messages           Anthropic Messages (system, tool_use / tool_result, stream)
    GET  /v1/models             running jobs (a model id is a job id)
    POST /v1/sessions           a new session id and its session-scoped API key (the service token)
    GET  /v1/sessions/{id}/trajectory (the token, or that session's key), DELETE /v1/sessions/{id} (the token)
    POST /v1/sessions/{id}/stage  the finished trial's tokens staged in the data plane its opener named (the token)
    GET  /v1/routing            sessions, admission queue and KV pressure per replica (the token)
    GET  /openapi.json          the generated schema (the token)
    GET  /health                liveness, no auth

docs/endpoint-api.md documents each route (auth, shapes, status codes, what v1 promises); the
session and trajectory shapes are the contract's models (dockyard/agents/contract.py). This
module declares the routes and maps errors to status codes; what a route does lives in
turns.py (a model call), auth.py (credentials, sessions), sessions.py (the recorder) and
convert.py (the OpenAI and Anthropic shapes).

Guarantees: the app needs a service token (create_app refuses none). Every route but /health needs
the token or a session key (`Authorization: Bearer` or `x-api-key`), else 401; what a session key
may not do is a 403 saying why (auth.py: a key is bound to its own session, and a header naming
another is refused, never followed). A call's session is its key's, or for the service token its
`X-Dockyard-Session` header (opened when new); the reply names it in `X-Dockyard-Session`. A
service-token call without the header is served but not recorded (nothing could continue it); a
key whose session is not open is a 404. Calls of one session run
one at a time. Every completion samples under the job's `policy.generation` temperature, top_p and
top_k, whatever the client sent, and its reply's `X-Dockyard-Sampling` header says which; only the
service token may ask for greedy decoding (`X-Dockyard-Sampling: greedy`, validation), a session
key that asks is a 403; a session the token opens with that header (POST /v1/sessions) is greedy
for all its turns, so an external scaffold holding only its key validates greedily. Image parts
pass the job's multimodal gate (dockyard/images.py) before any replica is asked: off, over its
limits or unreadable is a 400 naming the key or the numbers; a turn with images is rendered afresh
as its own segment, and the ids the rollout reports (image tokens included) are what the trajectory
records. Errors are JSON `{"type": "error", "error": {"type", "message", "param", "code"}}`
(readable by both official clients): malformed JSON 400, a body that does not
fit the schema 422 naming the field, a body over max_body_bytes 413, unknown
model 404, too many sessions or turns 429, a new session refused admission 503
(the queue is full or it waited too long: the agent's trial is lost, not scored), no replica left 503 (a session that
already took a turn then ends as an infrastructure error: its trajectory says
so and later calls get 409; a session whose replica failed goes on on another
one when there is one). No request error stops the endpoint serving other sessions. A streamed call
(`stream: true`) generates through the replica's GenerateStream and sends text as it comes
(streaming.py holds back what the finished reply could change; sse.py and responses.py shape the
events); its status is sent once the first tokens came, so a call refused before generating gets its
error status; an error after that ends the stream with the API's error event; a client that goes
away cancels the turn.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dockyard.agents.contract import (
    SAMPLING_GREEDY,
    SAMPLING_HEADER,
    SESSION_HEADER,
    SessionDeleted,
    SessionOpen,
    SessionOpened,
)
from services.endpoint.auth import Forbidden, Gate, Unauthorized
from services.endpoint.backend import Backend, GenerateRefused, ReplicaLost, UnknownModel
from services.endpoint.convert import anthropic_reply, from_anthropic, from_openai, openai_reply
from services.endpoint.errors import BadRequest, BodyLimit, error_response, invalid_body
from services.endpoint.responses import output_items, response_body, response_events, summarized, wants_logprobs
from services.endpoint.responses import to_chat as responses_chat
from services.endpoint.routing import AdmissionRefused
from services.endpoint.schemas import ChatCompletionRequest, CountTokensRequest, MessagesRequest, ResponsesRequest
from services.endpoint.sessions import SessionEnded, SessionLimit, SessionStore, UnknownSession
from services.endpoint.settings import EndpointSettings
from services.endpoint.sse import EventStream, Failed, anthropic_events, openai_chunks
from services.endpoint.staging import TrialStager, advertised
from services.endpoint.streaming import LiveTurn
from services.endpoint.turns import TurnSampling, prompt_tokens, take_turn

# Each refusal the endpoint raises, as its status code, error type and code.
ERRORS: tuple[tuple[type[Exception], int, str, str], ...] = (
    (Unauthorized, 401, "authentication_error", "invalid_api_key"),
    (Forbidden, 403, "permission_error", "forbidden"),
    (UnknownSession, 404, "not_found_error", "session_not_found"),
    (BadRequest, 400, "invalid_request_error", "invalid_request"),
    (GenerateRefused, 400, "invalid_request_error", "generate_refused"),
    (UnknownModel, 404, "not_found_error", "model_not_found"),
    (SessionLimit, 429, "rate_limit_error", "session_limit"),
    (AdmissionRefused, 503, "overloaded_error", "overloaded"),
    (SessionEnded, 409, "infrastructure_error", "session_ended"),
    (ReplicaLost, 503, "infrastructure_error", "replica_lost"),
)
# What the router says of a path it has no route for (404) or a method a route does not take (405).
NO_ROUTE = {404: "Not Found", 405: "Method Not Allowed"}


def failed(exc: Exception) -> Failed:
    """An error raised once a stream started, as the error event that ends it."""
    for kind, _, name, code in ERRORS:
        if isinstance(exc, kind):
            return Failed(name, str(exc), code)
    return Failed("api_error", f"{type(exc).__name__}: {exc}"[:2000])


async def guarded(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A live turn's events, an error ending them as a Failed event (the stream's status is sent already)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield failed(exc)


def anthropic_client(request: Request) -> bool:
    """Whether the caller speaks the Anthropic API (its clients send `anthropic-version` on every call)."""
    return "anthropic-version" in request.headers


def describe_model(job, request: Request) -> dict:
    """A running job as its caller's API describes a model: Anthropic's ModelInfo or OpenAI's Model."""
    if anthropic_client(request):
        created = datetime.fromtimestamp(job.create_time.seconds, UTC).isoformat().replace("+00:00", "Z")
        return {
            "type": "model",
            "id": job.job_id,
            "display_name": job.job_id,
            "created_at": created,
            "lifecycle": "active",
        }
    return {"id": job.job_id, "object": "model", "created": job.create_time.seconds, "owned_by": "dockyard"}


def create_app(settings: EndpointSettings, token: str, backend: Backend | None = None) -> FastAPI:
    gate = Gate(token)  # first: no app exists without a service token
    stager = TrialStager()  # the data planes sessions were opened with (staging.py)
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
            app.state.backend = Backend.from_settings(settings)
        yield
        await app.state.backend.close()
        await stager.close()

    # The schema is served below, behind the service token; no interactive docs pages.
    app = FastAPI(title="dockyard policy endpoint", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.store, app.state.backend = store, backend
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return invalid_body(exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if NO_ROUTE.get(exc.status_code) == exc.detail:
            message = (
                f"{request.method} {request.url.path} is not a route of the dockyard policy endpoint "
                "(docs/endpoint-api.md lists them)"
            )
            return error_response(exc.status_code, "not_found_error", message, code="unsupported_route")
        if exc.status_code == 413:
            return error_response(413, "request_too_large", str(exc.detail), code="request_too_large")
        return error_response(exc.status_code, "invalid_request_error", str(exc.detail))

    for kind, status, name, code in ERRORS:

        async def handler(_, exc, status=status, name=name, code=code):
            return error_response(status, name, str(exc), code=code)

        app.add_exception_handler(kind, handler)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return error_response(500, "api_error", f"{type(exc).__name__}: {exc}"[:2000])

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(store)}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        gate.admin(request, "the OpenAPI schema")
        return app.openapi()

    @app.get("/v1/models")
    async def models(request: Request):
        gate.caller(request)
        described = [describe_model(j, request) for j in await app.state.backend.running_jobs()]
        if not anthropic_client(request):
            return {"object": "list", "data": described}
        ids = [m["id"] for m in described]
        return {
            "data": described,
            "has_more": False,
            "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None,
        }

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: Request):
        gate.caller(request)
        for job in await app.state.backend.running_jobs():
            if job.job_id == model_id:
                return describe_model(job, request)
        raise UnknownModel(f"model {model_id!r}: no running job has this id (GET /v1/models lists them)")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request):
        gate.caller(request)
        # The same conversion as a call's; `thinking` shapes a reply, not the prompt counted here.
        fields = {k: v for k, v in dict(body).items() if k != "thinking"}
        chat = from_anthropic(MessagesRequest(**fields, max_tokens=1))
        return {"input_tokens": await prompt_tokens(app.state.backend, body.model, chat)}

    def greedy(request: Request) -> bool:
        """Whether the call asks for greedy decoding (a validation trial's): the service token's only."""
        asked = request.headers.get(SAMPLING_HEADER)
        if asked is None:
            return False
        if asked != SAMPLING_GREEDY:
            raise BadRequest(
                f"{SAMPLING_HEADER}: the only value a request may send is {SAMPLING_GREEDY!r}; the job's "
                "sampling settings are authoritative"
            )
        gate.admin(request, f"{SAMPLING_HEADER}: {SAMPLING_GREEDY} (a validation call's greedy decoding)")
        return True

    def reply_headers(session_id: str | None, law: TurnSampling) -> dict[str, str]:
        return {SAMPLING_HEADER: law.header(), **({SESSION_HEADER: session_id} if session_id else {})}

    def turn(request: Request, body, to_chat, live: LiveTurn | None = None):
        """One turn of the caller's session (credentials first, then the body as a Chat), not yet awaited."""
        session_id, create = gate.session_of(request)
        chat = to_chat(body)
        return session_id, take_turn(
            app.state.backend, store, body.model, chat, session_id, create, greedy(request), live
        )

    async def streamed(request: Request, body, to_chat, reply) -> EventStream:
        """A streamed turn: its reply starts once the first tokens came (an error before that is an error
        status, as for a non-streamed call); `reply(live, events)` makes the SSE lines. The client going
        away cancels the turn (its generation stops, nothing is recorded)."""
        live = LiveTurn()
        session_id, coroutine = turn(request, body, to_chat, live)
        task = live.run(coroutine)
        await live.first(task)

        async def body_lines():
            try:
                async for line in reply(live, guarded(live.events(task, pause=response.flush))):
                    yield line
            finally:
                if not task.done():
                    task.cancel()

        response = EventStream(body_lines(), headers=reply_headers(session_id, live.law))
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            return await streamed(
                request,
                body,
                from_openai,
                lambda live, events: openai_chunks(body.model, body.n, events, body.logprobs, with_usage),
            )
        session_id, coroutine = turn(request, body, from_openai)
        served = await coroutine
        reply = openai_reply(body.model, served.choices, served.usage, body.logprobs)
        return JSONResponse(reply, headers=reply_headers(session_id, served.sampling))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        if body.stream:
            return await streamed(
                request,
                body,
                from_anthropic,
                lambda live, events: anthropic_events(body.model, live.prompt_tokens, events),
            )
        session_id, coroutine = turn(request, body, from_anthropic)
        served = await coroutine
        reply = anthropic_reply(body.model, served.choices[0], served.usage)
        return JSONResponse(reply, headers=reply_headers(session_id, served.sampling))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        if body.stream:
            return await streamed(
                request, body, responses_chat, lambda live, events: response_events(body, live.law, events)
            )
        session_id, coroutine = turn(request, body, responses_chat)
        served = await coroutine
        choice = served.choices[0]
        items = output_items(choice, summarized(body), wants_logprobs(body))
        reply = response_body(body, choice, served.usage, served.sampling, f"resp_{uuid.uuid4().hex}", items)
        return JSONResponse(reply, headers=reply_headers(session_id, served.sampling))

    @app.get("/v1/routing")
    async def routing(request: Request):
        gate.admin(request, "the routing state")
        return app.state.backend.router.snapshot()

    @app.post("/v1/sessions")
    async def new_session(request: Request, body: SessionOpen | None = None):
        session_id, api_key = gate.open_session(request)
        # Held from now on: its key's calls find it (SessionLimit when full). Opened greedy (a validation
        # trial's), every turn of it is greedy, whatever its key's calls send.
        session = store.open(session_id, greedy=greedy(request))
        if body is not None and body.staging is not None:
            advertised(body.staging)  # a 400 now, not when the trial ends
            session.staging = body.staging  # only the service token gets here (open_session)
        return SessionOpened(session_id=session_id, api_key=api_key).to_json()

    @app.post("/v1/sessions/{session_id}/stage")
    async def stage(session_id: str, request: Request):
        gate.admin(request, "staging a session's trial")
        if (session := store.get(session_id)) is None:
            raise HTTPException(404, f"no session {session_id!r}")
        return (await stager.stage(session)).to_json()

    @app.get("/v1/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str, request: Request):
        gate.may_read(request, session_id)
        if (session := store.get(session_id)) is None:
            raise HTTPException(404, f"no session {session_id!r}")
        return session.trajectory()

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, request: Request):
        gate.admin(request, "ending a session")
        if not store.delete(session_id):
            raise HTTPException(404, f"no session {session_id!r}")
        app.state.backend.router.release(session_id)
        return SessionDeleted(deleted=session_id).to_json()

    return app
