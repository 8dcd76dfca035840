"""The server interceptors pass every handler kind through, in either shape grpc.aio accepts.

Four kinds (unary or streaming requests, unary or streaming replies), and for streamed replies two
shapes: an async generator, and a coroutine that writes with context.write (grpc's own health Watch).
Through TokenAuthInterceptor and RpcContextInterceptor, as `serve` stacks them, each answers what the
handler answers with the right token, UNAUTHENTICATED without it, and a ServiceError raised inside
becomes its own status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from dockyard.rpc.auth import TokenAuthInterceptor
from dockyard.rpc.errors import FailedPrecondition
from dockyard.rpc.server import RpcContextInterceptor

TOKEN = "unit-token"
SERVICE = "test.Kinds"


def _reply(request: bytes) -> bytes:
    if request == b"refuse":
        raise FailedPrecondition("refused on purpose")
    return request.upper()


async def unary_unary(request: bytes, context) -> bytes:
    return _reply(request)


async def unary_stream_generator(request: bytes, context) -> AsyncIterator[bytes]:
    for _ in range(2):
        yield _reply(request)


async def unary_stream_writer(request: bytes, context) -> None:
    for _ in range(2):
        await context.write(_reply(request))


async def stream_unary(requests: AsyncIterator[bytes], context) -> bytes:
    return b"".join([_reply(r) async for r in requests])


async def stream_stream_generator(requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
    async for request in requests:
        yield _reply(request)


async def stream_stream_writer(requests: AsyncIterator[bytes], context) -> None:
    async for request in requests:
        await context.write(_reply(request))


HANDLERS = {
    "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
    "UnaryStreamGenerator": grpc.unary_stream_rpc_method_handler(unary_stream_generator),
    "UnaryStreamWriter": grpc.unary_stream_rpc_method_handler(unary_stream_writer),
    "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
    "StreamStreamGenerator": grpc.stream_stream_rpc_method_handler(stream_stream_generator),
    "StreamStreamWriter": grpc.stream_stream_rpc_method_handler(stream_stream_writer),
}


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN), RpcContextInterceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, HANDLERS)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _call(channel: grpc.aio.Channel, name: str, payload: bytes, metadata, sent: int = 2) -> list[bytes]:
    path, payloads = f"/{SERVICE}/{name}", [payload] * sent
    if name == "UnaryUnary":
        return [await channel.unary_unary(path)(payload, metadata=metadata, timeout=10)]
    if name.startswith("UnaryStream"):
        return [r async for r in channel.unary_stream(path)(payload, metadata=metadata, timeout=10)]
    if name == "StreamUnary":
        return [await channel.stream_unary(path)(iter(payloads), metadata=metadata, timeout=10)]
    return [r async for r in channel.stream_stream(path)(iter(payloads), metadata=metadata, timeout=10)]


EXPECTED = {
    "UnaryUnary": [b"HI"],
    "UnaryStreamGenerator": [b"HI", b"HI"],
    "UnaryStreamWriter": [b"HI", b"HI"],
    "StreamUnary": [b"HIHI"],
    "StreamStreamGenerator": [b"HI", b"HI"],
    "StreamStreamWriter": [b"HI", b"HI"],
}


async def _refusal(channel: grpc.aio.Channel, name: str, metadata) -> tuple[grpc.StatusCode, str]:
    """The status of a call refused before its handler runs. A streamed request sends no message: one
    written after the server has answered fails in the client's own writer (grpc-python reports that
    race as INTERNAL, whatever the server said), which says nothing about the interceptor."""
    path = f"/{SERVICE}/{name}"
    if name == "UnaryUnary":
        call = channel.unary_unary(path)(b"hi", metadata=metadata, timeout=10)
    elif name.startswith("UnaryStream"):
        call = channel.unary_stream(path)(b"hi", metadata=metadata, timeout=10)
    elif name == "StreamUnary":
        call = channel.stream_unary(path)(metadata=metadata, timeout=10)
    else:
        call = channel.stream_stream(path)(metadata=metadata, timeout=10)
    return await call.code(), await call.details()


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_every_kind_answers_with_the_token_and_is_refused_without(address: str, name: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        assert await _call(channel, name, b"hi", (("authorization", f"Bearer {TOKEN}"),)) == EXPECTED[name]
        code, details = await _refusal(channel, name, ())
        assert code == grpc.StatusCode.UNAUTHENTICATED and "missing credentials" in details, details
        code, details = await _refusal(channel, name, (("authorization", "Bearer nope"),))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "invalid credentials" in details, details


@pytest.mark.parametrize("name", list(HANDLERS))
async def test_a_service_error_keeps_its_code_in_every_kind(address: str, name: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            # one message: a second one written after the refusal would race the server's answer
            await _call(channel, name, b"refuse", (("authorization", f"Bearer {TOKEN}"),), sent=1)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert "refused on purpose" in refused.value.details()
