"""Client channels: size limits, a deadline on every call, safe retries.

Every unary call made through `connect()` carries a deadline (the caller's
`timeout=` or the channel default), so a dead peer never hangs a caller; a
streaming caller sets its own (the endpoint's long-lived GenerateMultiplexed
stream has none, and bounds each of its calls instead).
The channel retries only the methods that dockyard.rpc.retry lists in
CHANNEL_RETRIED (idempotent, retried by no caller), and only on UNAVAILABLE.
With DOCKYARD_AUTH_TOKEN(_FILE) set, every call carries `authorization: Bearer
<token>`; with DOCKYARD_TLS_* set, channels are mutual TLS (see auth.py). Health checks use the same transport.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dockyard.rpc.auth import AUTH_METADATA_KEY, AuthSettings, bearer, load_auth_settings
from dockyard.rpc.retry import channel_service_config
from dockyard.rpc.server import message_size_options


class _CallDefaults(grpc.aio.UnaryUnaryClientInterceptor):
    """A deadline, the caller's request id and the shared token on every unary call."""

    def __init__(self, timeout: float, token: str | None) -> None:
        self._timeout = timeout
        self._authorization = bearer(token) if token else None

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        details = client_call_details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        request_id = structlog.contextvars.get_contextvars().get("request_id")
        if request_id and "x-request-id" not in metadata:
            metadata.add("x-request-id", request_id)
        if self._authorization and AUTH_METADATA_KEY not in metadata:
            metadata.add(AUTH_METADATA_KEY, self._authorization)
        details = grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout if details.timeout is not None else self._timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )
        return await continuation(details, request)


def _with_token(details: grpc.aio.ClientCallDetails, authorization: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    if AUTH_METADATA_KEY not in metadata:
        metadata.add(AUTH_METADATA_KEY, authorization)
    return grpc.aio.ClientCallDetails(
        method=details.method,
        timeout=details.timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


# grpc.aio files each interceptor under one call kind only, so one class per streaming kind.
class _UnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, authorization: str) -> None:
        self._authorization = authorization

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._authorization), request)


class _StreamUnaryToken(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, authorization: str) -> None:
        self._authorization = authorization

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self._authorization), request_iterator)


class _StreamStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, authorization: str) -> None:
        self._authorization = authorization

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self._authorization), request_iterator)


def connect(
    address: str,
    *,
    service: str | None = None,
    default_timeout: float = 30.0,
    max_message_mb: int = 64,
    auth: AuthSettings | None = None,
    max_reconnect_backoff: float | None = None,
) -> grpc.aio.Channel:
    """A channel to `address`; calls to `service`'s CHANNEL_RETRIED methods are retried.

    `auth` (default: read from the environment) adds the shared token and mTLS when configured.
    `max_reconnect_backoff` caps gRPC's wait between reconnection attempts (120 s by default), for
    callers that must notice quickly that a peer is back.
    """
    auth = auth or load_auth_settings()
    options = [
        *message_size_options(max_message_mb),
        ("grpc.service_config", channel_service_config(service)),
        ("grpc.enable_retries", 1),
    ]
    if max_reconnect_backoff is not None:
        backoff_ms = max(100, int(max_reconnect_backoff * 1000))
        options += [("grpc.max_reconnect_backoff_ms", backoff_ms), ("grpc.initial_reconnect_backoff_ms", backoff_ms)]
    interceptors: list = [_CallDefaults(default_timeout, auth.token)]
    if auth.token:
        # Streaming calls carry it too, should a service ever define one.
        streaming = (_UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
        interceptors += [kind(bearer(auth.token)) for kind in streaming]
    return _channel(address, auth, options, interceptors)


def _channel(address: str, auth: AuthSettings, options: list, interceptors: list | None = None) -> grpc.aio.Channel:
    credentials = auth.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    options = [*options, *auth.channel_options()]
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


async def channel_health(channel: grpc.aio.Channel, service: str = "", timeout: float = 2.0) -> str:
    """The standard health status name of `service` behind an open channel, or UNREACHABLE."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def health_status(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The standard health status name of `service` at `address`, or UNREACHABLE."""
    async with _channel(address, load_auth_settings(), []) as channel:
        return await channel_health(channel, service, timeout)


async def wait_until_serving(address: str, timeout: float, service: str = "") -> None:
    """Poll the health service until SERVING; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        status = await health_status(address, service)
        if status == "SERVING":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s (last status: {status})")
        await asyncio.sleep(0.2)
