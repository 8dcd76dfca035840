"""The policy endpoint's HTTP API (FastAPI): OpenAI chat completions, Anthropic messages, models, sessions.

    POST /v1/chat/completions   OpenAI Chat Completions (tools, n, logprobs, stream)
    POST /v1/messages           Anthropic Messages (system, tool_use / tool_result, stream)
    GET  /v1/models             running jobs (a model id is a job id)
    POST /v1/sessions           a new session id and its session-scoped API key
    GET  /v1/sessions/{id}/trajectory, DELETE /v1/sessions/{id}
    GET  /v1/routing            sessions, admission queue and KV pressure per replica
    GET  /health                liveness, no auth

docs/endpoint-api.md documents each route (auth, shapes, status codes, what v1 promises); the
session and trajectory shapes are the contract's models (dockyard/agents/contract.py). This
module declares the routes and maps errors to status codes; what a route does lives in
turns.py (a model call), auth.py (credentials, sessions), sessions.py (the recorder) and
convert.py (the OpenAI and Anthropic shapes).

Guarantees: with DOCKYARD_AUTH_TOKEN set, every /v1 route needs the token or a
session key (`Authorization: Bearer` or `x-api-key`), else 401. A call's
session is its `X-Dockyard-Session` header, else its session key's; the reply
names it in `X-Dockyard-Session`. A call with neither is served but not
recorded (nothing could continue it). Calls of one session run
one at a time. Every completion samples under the job's `policy.generation` temperature, top_p and
top_k, whatever the client sent, and its reply's `X-Dockyard-Sampling` header says which; only the
service token may ask for greedy decoding (`X-Dockyard-Sampling: greedy`, validation), a session
key that asks is a 401. Image parts pass the job's multimodal gate (dockyard/images.py) before any replica
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

import contextlib

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
from services.endpoint.auth import Gate, Unauthorized
from services.endpoint.backend import Backend, GenerateRefused, ReplicaLost, UnknownModel
from services.endpoint.convert import (
    BadRequest,
    anthropic_events,
    anthropic_reply,
    from_anthropic,
    from_openai,
    openai_chunks,
    openai_reply,
)
from services.endpoint.errors import BodyLimit, error_response, invalid_body
from services.endpoint.routing import AdmissionRefused
from services.endpoint.schemas import ChatCompletionRequest, MessagesRequest
from services.endpoint.sessions import SessionEnded, SessionLimit, SessionStore
from services.endpoint.settings import EndpointSettings
from services.endpoint.turns import Served, take_turn

# Each refusal the endpoint raises, as its status code and error type.
ERRORS: tuple[tuple[type[Exception], int, str], ...] = (
    (Unauthorized, 401, "authentication_error"),
    (BadRequest, 400, "invalid_request_error"),
    (GenerateRefused, 400, "invalid_request_error"),
    (UnknownModel, 404, "not_found_error"),
    (SessionLimit, 429, "rate_limit_error"),
    (AdmissionRefused, 503, "overloaded_error"),
    (SessionEnded, 409, "infrastructure_error"),
    (ReplicaLost, 503, "infrastructure_error"),
)


def create_app(settings: EndpointSettings, token: str | None, backend: Backend | None = None) -> FastAPI:
    store = SessionStore(
        settings.max_sessions,
        settings.session_idle_seconds,
        settings.max_turns_per_session,
        on_drop=lambda session_id: app.state.backend.router.release(session_id),
    )
    gate = Gate(token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # gRPC channels belong to the event loop that serves: made here, not when the app is built.
        if app.state.backend is None:
            app.state.backend = Backend.from_settings(settings)
        yield
        await app.state.backend.close()

    app = FastAPI(title="dockyard policy endpoint", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.store, app.state.backend = store, backend
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return invalid_body(exc)

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
        return error_response(exc.status_code, kind, str(exc.detail))

    for kind, status, name in ERRORS:

        async def handler(_, exc, status=status, name=name):
            return error_response(status, name, str(exc))

        app.add_exception_handler(kind, handler)

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        return error_response(500, "api_error", f"{type(exc).__name__}: {exc}"[:2000])

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(store)}

    @app.get("/v1/models")
    async def models(request: Request):
        gate.authorize(request)
        jobs = await app.state.backend.running_jobs()
        data = [
            {"id": j.job_id, "object": "model", "created": j.create_time.seconds, "owned_by": "dockyard"} for j in jobs
        ]
        return {"object": "list", "data": data}

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
        if gate.authorize(request) is not None:
            raise Unauthorized(
                f"{SAMPLING_HEADER}: {SAMPLING_GREEDY} is for validation calls with the service token; a session "
                "samples with the job's settings"
            )
        return True

    def reply_headers(session_id: str | None, served: Served) -> dict[str, str]:
        return {SAMPLING_HEADER: served.sampling.header(), **({SESSION_HEADER: session_id} if session_id else {})}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        session_id = gate.session_of(request)
        served = await take_turn(app.state.backend, store, body.model, from_openai(body), session_id, greedy(request))
        headers = reply_headers(session_id, served)
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = openai_chunks(body.model, served.choices, served.usage, body.logprobs, with_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(openai_reply(body.model, served.choices, served.usage, body.logprobs), headers=headers)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        session_id = gate.session_of(request)
        served = await take_turn(
            app.state.backend, store, body.model, from_anthropic(body), session_id, greedy(request)
        )
        headers = reply_headers(session_id, served)
        if body.stream:
            stream = anthropic_events(body.model, served.choices[0], served.usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return JSONResponse(anthropic_reply(body.model, served.choices[0], served.usage), headers=headers)

    @app.get("/v1/routing")
    async def routing(request: Request):
        gate.authorize(request)
        return app.state.backend.router.snapshot()

    @app.post("/v1/sessions")
    async def new_session(request: Request):
        session_id, api_key = gate.open_session(request)
        return SessionOpened(session_id=session_id, api_key=api_key).to_json()

    @app.get("/v1/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str, request: Request):
        session = store.get(session_id) if gate.may_read(request, session_id) else None
        if session is None:
            raise HTTPException(404, f"no session {session_id!r}")
        return session.trajectory()

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, request: Request):
        if not gate.may_read(request, session_id) or not store.delete(session_id):
            raise HTTPException(404, f"no session {session_id!r}")
        app.state.backend.router.release(session_id)
        return SessionDeleted(deleted=session_id).to_json()

    return app
