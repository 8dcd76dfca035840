"""A grpc.aio server with what every dockyard service needs.

    request --> TokenAuthInterceptor --> RpcContextInterceptor --> servicer (unary or streaming, either way)
                 (when a token is set:    bytes that do not parse: INVALID_ARGUMENT naming the method;
                  UNAUTHENTICATED         binds rpc / request_id / job_id into every log line,
                  without it; see auth.py) turns ServiceError into its status code, INTERNAL otherwise

Guarantees: the standard health service and server reflection are on (so
`grpcurl -plaintext HOST:PORT list` works without proto files; with a token
configured, both stay open and every dockyard method needs it); the port is plaintext
or, with DOCKYARD_TLS_*, mutual TLS; message-size
limits match the clients'; on SIGTERM or SIGINT every service reports
NOT_SERVING first and keeps serving for `drain_seconds` (so health checkers
and load balancers see it go), then each service's `on_drain` runs and the server stops with a grace
period for in-flight calls, then the service's own shutdown hook runs. A request that does not
parse (invalid UTF-8 in a string, nesting past protobuf's recursion limit, truncated
bytes) is INVALID_ARGUMENT naming the method, never UNKNOWN. Every handler kind passes the
interceptors in its own shape, so health Watch (a coroutine writing its stream) streams.
"""

from __future__ import annotations

import asyncio
import inspect
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
    # Called as the server stops (after drain_seconds): a long-lived stream the service serves can end itself
    # then, rather than hold the stop for its whole grace period.
    on_drain: Callable[[], None] | None = None


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


@dataclass(frozen=True)
class _CallContext:
    """What one call's wrapper needs: its method (for messages and logs) and its metadata."""

    method: str
    metadata: dict[str, Any]

    async def refuse_undecodable(self, request, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, _Undecodable):
            log.info("rpc refused", rpc=self.method, code="INVALID_ARGUMENT", error=request.error)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, clip(f"{self.method}: the request does not parse ({request.error})")
            )

    def ids(self, request) -> dict[str, str]:
        bound = {"rpc": self.method, "request_id": self.metadata.get("x-request-id") or uuid.uuid4().hex[:16]}
        if job_id := getattr(request, "job_id", ""):
            bound["job_id"] = job_id
        return bound

    async def checked(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            await self.refuse_undecodable(request, context)
            yield request

    @asynccontextmanager
    async def around(self, first, context: grpc.aio.ServicerContext, streamed: bool) -> AsyncIterator[Any]:
        """Yields what the servicer gets first: the request, or the checked request stream."""
        if not streamed:
            await self.refuse_undecodable(first, context)
        with structlog.contextvars.bound_contextvars(**self.ids(None if streamed else first)):
            async with _answered(context):
                yield self.checked(first, context) if streamed else first

    def wrap(self, inner: Callable[..., Any], streamed: bool) -> Callable[..., Any]:
        """A handler function of inner's own shape. grpc.aio takes an async generator (it iterates the
        replies) or a coroutine (it returns the reply, or writes a stream with context.write, as grpc's
        health Watch does): iterating a coroutine, or awaiting a generator, would be INTERNAL."""
        if inspect.isasyncgenfunction(inner):

            async def stream(first, context: grpc.aio.ServicerContext):
                async with self.around(first, context, streamed) as given:
                    async for reply in inner(given, context):
                        yield reply

            return stream

        async def call(first, context: grpc.aio.ServicerContext):
            async with self.around(first, context, streamed) as given:
                result = inner(given, context)
                return await result if inspect.isawaitable(result) else result

        return call


class RpcContextInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each handler, of any of the four kinds, in one of the same kind and shape."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        call = _CallContext(handler_call_details.method, dict(handler_call_details.invocation_metadata or ()))
        kinds = (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
        )
        inner, make = next((inner, make) for inner, make in kinds if inner is not None)
        return make(
            call.wrap(inner, streamed=handler.request_streaming),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


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
    # gRPC binds with SO_REUSEPORT on Linux by default: a second server on a port one holds would bind too
    # and take a share of its connections, silently. Off, the second one fails with BindError.
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[*message_size_options(settings.max_message_mb), ("grpc.so_reuseport", 0)],
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
    for service in services:
        if service.on_drain is not None:
            service.on_drain()
    await server.stop(settings.shutdown_grace_seconds)
    if on_stop is not None:
        await on_stop()
    log.info("stopped")
