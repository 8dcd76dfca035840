"""The policy endpoint's HTTP API (FastAPI): OpenAI chat completions, Anthropic messages, models, sessions.

    POST /v1/chat/completions   OpenAI Chat Completions (tools, n, logprobs, stream)
    POST /v1/messages           Anthropic Messages (system, tool_use / tool_result, stream)
    GET  /v1/models             running jobs (a model id is a job id)
    POST /v1/sessions           a new session id and its session-scoped API key (the service token)
    GET  /v1/sessions/{id}/trajectory (the token, or that session's key), DELETE /v1/sessions/{id} (the token)
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
one when there is one). No request error stops the endpoint serving other sessions.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from dockyard.agents.contract import (
    SAMPLING_GREEDY,
    SAMPLING_HEADER,
    SESSION_HEADER,
    SessionDeleted,
    SessionOpened,
)
from services.endpoint.auth import Forbidden, Gate, Unauthorized
from services.endpoint.backend import Backend, GenerateRefused, ReplicaLost, UnknownModel
from services.endpoint.convert import (
    anthropic_events,
    anthropic_reply,
    from_anthropic,
    from_openai,
    openai_chunks,
    openai_reply,
)
from services.endpoint.errors import BadRequest, BodyLimit, error_response, invalid_body
from services.endpoint.responses import output_items, response_body, response_events, summarized, wants_logprobs
from services.endpoint.responses import to_chat as responses_chat
from services.endpoint.routing import AdmissionRefused
from services.endpoint.schemas import ChatCompletionRequest, CountTokensRequest, MessagesRequest, ResponsesRequest
from services.endpoint.sessions import SessionEnded, SessionLimit, SessionStore, UnknownSession
from services.endpoint.settings import EndpointSettings
from services.endpoint.turns import Served, prompt_tokens, take_turn

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

    def reply_headers(session_id: str | None, served: Served) -> dict[str, str]:
        return {SAMPLING_HEADER: served.sampling.header(), **({SESSION_HEADER: session_id} if session_id else {})}

    async def serve(request: Request, body, to_chat) -> tuple[Served, dict[str, str]]:
        """One turn of the caller's session (credentials first, then the body as a Chat) and the reply's headers."""
        session_id, create = gate.session_of(request)
        chat = to_chat(body)
        served = await take_turn(app.state.backend, store, body.model, chat, session_id, create, greedy(request))
        return served, reply_headers(session_id, served)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served, headers = await serve(request, body, from_openai)
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = openai_chunks(body.model, served.choices, served.usage, body.logprobs, with_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(openai_reply(body.model, served.choices, served.usage, body.logprobs), headers=headers)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        served, headers = await serve(request, body, from_anthropic)
        if body.stream:
            stream = anthropic_events(body.model, served.choices[0], served.usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(anthropic_reply(body.model, served.choices[0], served.usage), headers=headers)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served, headers = await serve(request, body, responses_chat)
        choice, law = served.choices[0], served.sampling
        if body.stream:
            stream = response_events(body, choice, served.usage, law)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        items = output_items(choice, summarized(body), wants_logprobs(body))
        reply = response_body(body, choice, served.usage, law, f"resp_{uuid.uuid4().hex}", items)
        return JSONResponse(reply, headers=headers)

    @app.get("/v1/routing")
    async def routing(request: Request):
        gate.admin(request, "the routing state")
        return app.state.backend.router.snapshot()

    @app.post("/v1/sessions")
    async def new_session(request: Request):
        session_id, api_key = gate.open_session(request)
        # Held from now on: its key's calls find it (SessionLimit when full). Opened greedy (a validation
        # trial's), every turn of it is greedy, whatever its key's calls send.
        store.open(session_id, greedy=greedy(request))
        return SessionOpened(session_id=session_id, api_key=api_key).to_json()

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
