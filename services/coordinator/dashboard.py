"""The dashboard: a read-only web page of the coordinator's jobs, their curves, the fleet and samples.

    browser ──GET /──> the page (dashboard_page.PAGE: plain JS, no CDN), which polls every 2 s:
            ──GET /api/state──> ListJobs + ListMembers (the coordinator's own gRPC API, as any client)
            ──GET /api/jobs/{id}──> GetJob, <run_dir>/metrics.jsonl (the curves), <run_dir>/samples.jsonl (last 20)

It runs in the coordinator process, on DOCKYARD_COORDINATOR_DASHBOARD_PORT (0: off), as a client
of the coordinator's public API: it never reaches into the servicer.

Guarantees: only GET routes, nothing it serves changes a job; with a service token set, every route
but /health needs it (`Authorization: Bearer <token>`, or `?token=<token>` once, which sets a
cookie for the page's own polling); a run folder that is missing or half-written gives the curves
read so far, never an error page; records are capped (the last MAX_POINTS per job).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from google.protobuf.json_format import MessageToDict

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.jobs import state_name
from dockyard.rpc.client import connect
from dockyard.rpc.server import BindError
from services.coordinator.dashboard_page import PAGE

log = structlog.get_logger()
MAX_POINTS = 2000
MAX_SAMPLES = 20
COOKIE = "dockyard_token"


def _tail_jsonl(path: Path, limit: int) -> list[dict[str, Any]]:
    """The last `limit` complete JSON lines of a file (a line being written is skipped)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    records = []
    for line in lines[-limit:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _member(m: coordinator_pb2.Member) -> dict[str, Any]:
    return {
        "name": m.name,
        "kind": coordinator_pb2.MemberKind.Name(m.kind).removeprefix("MEMBER_KIND_").lower(),
        "status": m.status,
        "address": m.address,
        "load": m.load,
        "in_flight": m.in_flight,
        "seen_seconds_ago": round(m.seconds_since_heartbeat, 1),
        "weight_versions": dict(m.weight_versions),
    }


def _job(job: coordinator_pb2.Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "state": state_name(job.state),
        "phase": job.phase,
        "step": job.step,
        "max_steps": job.max_steps,
        "message": job.message,
        "metrics": dict(job.metrics),
        "validation": dict(job.validation_metrics),
    }


def create_app(coordinator_address: str, token: str | None, resolve_run_dir: Callable[[str], Path]) -> FastAPI:
    app = FastAPI(title="dockyard dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    channel: list[grpc.aio.Channel] = []

    def stub() -> coordinator_pb2_grpc.CoordinatorServiceStub:
        if not channel:
            channel.append(connect(coordinator_address, service="coordinator"))
        return coordinator_pb2_grpc.CoordinatorServiceStub(channel[0])

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token is None or request.url.path == "/health":
            return await call_next(request)
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        given = given or request.query_params.get("token", "") or request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "missing or wrong token: ?token=<token> or Authorization: Bearer"}, 401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return PAGE

    @app.get("/api/state")
    async def state() -> dict[str, Any]:
        jobs = await stub().ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10, metadata=metadata)
        members = await stub().ListMembers(coordinator_pb2.ListMembersRequest(), timeout=10, metadata=metadata)
        return {"jobs": [_job(j) for j in jobs.jobs], "fleet": [_member(m) for m in members.members]}

    @app.get("/api/jobs/{job_id}")
    async def job(job_id: str) -> dict[str, Any]:
        try:
            reply = await stub().GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise HTTPException(404, f"no job {job_id!r}") from None
            raise
        folder = resolve_run_dir(reply.job.run_dir)
        records, samples = await asyncio.to_thread(
            lambda: (
                _tail_jsonl(folder / "metrics.jsonl", MAX_POINTS),
                _tail_jsonl(folder / "samples.jsonl", MAX_SAMPLES),
            )
        )
        detail = _job(reply.job)
        detail["services"] = [MessageToDict(s, preserving_proto_field_name=True) for s in reply.job.services]
        return {"job": detail, "records": records, "samples": samples}

    @app.exception_handler(grpc.aio.AioRpcError)
    async def coordinator_error(request: Request, exc: grpc.aio.AioRpcError) -> Response:
        return JSONResponse({"error": f"the coordinator answered {exc.code().name}: {exc.details()}"}, 503)

    return app


async def serve_dashboard(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    """Start serving `app` in this event loop; returns the server (`should_exit = True` stops it)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    server.install_signal_handlers = lambda: None  # the coordinator's own handlers stop the process
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():  # uvicorn exits (SystemExit) when it cannot bind
            raise BindError(f"coordinator: the dashboard cannot bind {host}:{port}: pick another port")
        await asyncio.sleep(0.05)
    log.info("dashboard serving", url=f"http://{host}:{port}/")
    server.task = task  # type: ignore[attr-defined]
    return server
