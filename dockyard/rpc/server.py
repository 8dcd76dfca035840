"""A grpc.aio server with what every dockyard service needs.

    request --> TokenAuthInterceptor --> RpcContextInterceptor --> servicer (unary, or streaming one way)
                 (when a token is set:    bytes that do not parse: INVALID_ARGUMENT naming the method;
                  UNAUTHENTICATED         binds rpc / request_id / job_id into every log line,
                  without it; see auth.py) turns ServiceError into its status code, INTERNAL otherwise

Guarantees: the standard health service and server reflection are on (so
`grpcurl -plaintext HOST:PORT list` works without proto files; with a token
configured, both stay open and every dockyard method needs it); the port is plaintext
or, with DOCKYARD_TLS_*, mutual TLS; message-size
limits match the clients'; on SIGTERM or SIGINT every service reports
NOT_SERVING first and keeps serving for `drain_seconds` (so health checkers
and load balancers see it go), then the server stops with a grace period for
in-flight calls, then the service's own shutdown hook runs. A request that does not
parse (invalid UTF-8 in a string, nesting past protobuf's recursion limit, truncated
bytes) is INVALID_ARGUMENT naming the method, never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dockyard.rpc.auth import AuthSettings, TokenAuthInterceptor, load_auth_settings
from dockyard.rpc.errors import ServiceError, clip
from dockyard.rpc.settings import ServiceSettings

log = structlog.get_logger()


def message_size_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


@dataclass(frozen=True)
class Service:
    """A servicer and what is needed to mount it."""

    name: str  # full proto name, e.g. "dockyard.buffer.v1.BufferService"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


@dataclass(frozen=True)
class _Undecodable:
    """What a request deserializer hands on when the bytes do not parse (grpc would answer UNKNOWN)."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, RecursionError, UnicodeDecodeError) as exc:
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return deserialize


class BindError(OSError):
    """The service's port cannot be bound: its process exits with this one line."""


@asynccontextmanager
async def _answered(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """A ServiceError raised inside becomes its status code, any other exception INTERNAL."""
    start = time.perf_counter()
    try:
        yield
    except ServiceError as exc:
        log.info("rpc refused", code=exc.code.name, error=clip(str(exc)))
        await context.abort(exc.code, clip(str(exc)))
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as exc:
        log.exception("rpc failed")
        await context.abort(grpc.StatusCode.INTERNAL, clip(f"{type(exc).__name__}: {exc}"))
    finally:
        log.debug("rpc done", seconds=round(time.perf_counter() - start, 4))


class RpcContextInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.stream_stream is not None:
            return handler
        method = handler_call_details.method
        metadata = dict(handler_call_details.invocation_metadata or ())

        async def refuse_undecodable(request, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _Undecodable):
                log.info("rpc refused", rpc=method, code="INVALID_ARGUMENT", error=request.error)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, clip(f"{method}: the request does not parse ({request.error})")
                )

        def ids(request) -> dict[str, str]:
            bound = {"rpc": method, "request_id": metadata.get("x-request-id") or uuid.uuid4().hex[:16]}
            if job_id := getattr(request, "job_id", ""):
                bound["job_id"] = job_id
            return bound

        serde = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def call(request, context: grpc.aio.ServicerContext):
                await refuse_undecodable(request, context)
                with structlog.contextvars.bound_contextvars(**ids(request)):
                    async with _answered(context):
                        return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(call, **serde)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def call_stream(request, context: grpc.aio.ServicerContext):
                await refuse_undecodable(request, context)
                with structlog.contextvars.bound_contextvars(**ids(request)):
                    async with _answered(context):
                        async for reply in inner_stream(request, context):
                            yield reply

            return grpc.unary_stream_rpc_method_handler(call_stream, **serde)
        inner_unary = handler.stream_unary

        async def call_streamed(request_iterator, context: grpc.aio.ServicerContext):
            async def checked():
                async for request in request_iterator:
                    await refuse_undecodable(request, context)
                    yield request

            with structlog.contextvars.bound_contextvars(**ids(None)):
                async with _answered(context):
                    return await inner_unary(checked(), context)

        return grpc.stream_unary_rpc_method_handler(call_streamed, **serde)


async def serve(
    name: str,
    settings: ServiceSettings,
    services: Sequence[Service],
    *,
    default_port: int,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    auth: AuthSettings | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop gracefully. `auth` defaults to the environment's."""
    auth = auth or load_auth_settings()
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcContextInterceptor()]
    if auth.token is not None:
        interceptors.insert(0, TokenAuthInterceptor(auth.token))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=message_size_options(settings.max_message_mb),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        service.add_to_server(service.servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = settings.port or default_port
    address = f"{settings.host}:{port}"
    credentials = auth.server_credentials()
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind": nothing more to say than the address
        bound = 0
    if bound == 0:
        raise BindError(f"{name}: cannot bind {address} (in use, or not an address of this host): pick another port")
    await server.start()
    for service_name in ["", *names]:
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", address=address, services=names, token_auth=auth.token is not None, tls=auth.tls)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_done = asyncio.ensure_future(server.wait_for_termination())
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([server_done, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    log.info("shutting down", grace_seconds=settings.shutdown_grace_seconds)
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(settings.drain_seconds)
    await server.stop(settings.shutdown_grace_seconds)
    if on_stop is not None:
        await on_stop()
    log.info("stopped")
