"""The endpoint's streamed calls to one replica, over one GenerateMultiplexed stream.

    stream(request, on_tokens) ──start {call_id, timeout}──> the replica's stream (opened on first use)
    replies ──reader──> each CallEvent's deltas straight to its call's on_tokens; its end settles the call
    the caller leaves (cancelled, or past its timeout) ──cancel {call_id}──> the generation stops there

Guarantees: a call sees exactly the messages GenerateStream would send it, in order, and ends with the result
or a CallFailed carrying the status GenerateStream would end with (its `code()` and `details()` read as a gRPC
error's); `on_tokens` is called on the reader's task, never after the call returned or raised, and an exception
it raises ends the call with it (the replica's call cancelled); a call past its timeout is cancelled on the
replica and fails DEADLINE_EXCEEDED. When the stream itself fails or ends, every call on it fails with that
status (UNAVAILABLE when it ended cleanly: the replica was stopping) and the next call opens a new stream, so one
broken stream never outlives its calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc
import structlog

from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.endpoint.streaming import TokenSink

log = structlog.get_logger()


class CallFailed(Exception):
    """A multiplexed call's failure, read as grpc.aio.AioRpcError is (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MultiplexedCalls:
    """One replica's streamed calls, sharing one GenerateMultiplexed stream."""

    def __init__(self, stub: rollout_pb2_grpc.RolloutServiceStub) -> None:
        self._stub = stub
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None

    async def stream(
        self, request: rollout_pb2.GenerateRequest, on_tokens: TokenSink, timeout: float
    ) -> rollout_pb2.GenerateResponse:
        """GenerateStream over the shared stream: deltas to `on_tokens` as they come (the last message's too),
        the result returned; CallFailed for the call's (or the stream's) failure."""
        if self._stream is None or self._stream.ended:
            self._stream = _Stream(self._stub)
        stream, call_id = self._stream, next(self._ids)
        ended = stream.open(call_id, on_tokens)
        try:
            async with asyncio.timeout(timeout):
                await stream.send(
                    rollout_pb2.GenerateMultiplexedRequest(
                        call_id=call_id,
                        start=rollout_pb2.GenerateStreamRequest(request=request),
                        timeout_seconds=timeout,
                    )
                )
                return await ended
        except TimeoutError:
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no result within {timeout:g} s") from None
        finally:
            stream.close(call_id)
            if ended.done() and not ended.cancelled():
                ended.exception()  # read: a failure this call did not await (its send failed) is not logged as lost

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.shut()


class _Stream:
    """One GenerateMultiplexed call: its calls' sinks, a reader handing replies out, writes one at a time."""

    def __init__(self, stub: rollout_pb2_grpc.RolloutServiceStub) -> None:
        # No deadline of its own: the stream lives as long as calls come; each call has its timeout.
        self._call = stub.GenerateMultiplexed(timeout=None)
        self._calls: dict[int, tuple[TokenSink, asyncio.Future]] = {}  # running on the replica
        self._writing = asyncio.Lock()
        self.ended = False
        self._reader = asyncio.ensure_future(self._read())

    def open(self, call_id: int, on_tokens: TokenSink) -> asyncio.Future:
        """The call's end: its result, or its CallFailed (or on_tokens' exception) raised."""
        ended = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (on_tokens, ended)
        return ended

    async def send(self, request: rollout_pb2.GenerateMultiplexedRequest) -> None:
        try:
            async with self._writing:  # grpc.aio takes one write at a time
                await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            failure = _failure(exc)
            self._fail(failure)
            raise failure from None

    def close(self, call_id: int) -> None:
        """The call is over for its caller; if it had not ended on the replica, the replica stops it."""
        if self._calls.pop(call_id, None) is not None and not self.ended:
            cancelled = rollout_pb2.GenerateMultiplexedRequest(
                call_id=call_id, cancel=rollout_pb2.GenerateMultiplexedCancel()
            )
            # Not awaited by the leaving caller (it may be being cancelled itself): a task of its own.
            asyncio.ensure_future(self._send_quietly(cancelled))

    async def _send_quietly(self, request: rollout_pb2.GenerateMultiplexedRequest) -> None:
        with contextlib.suppress(CallFailed):
            await self.send(request)

    async def _read(self) -> None:
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                for event in reply.events:
                    if (call := self._calls.get(event.call_id)) is not None:
                        self._hand_out(event, *call)
            self._fail(CallFailed(grpc.StatusCode.UNAVAILABLE, "the replica ended the stream (it is stopping)"))
        except grpc.aio.AioRpcError as exc:
            self._fail(_failure(exc))
        except asyncio.CancelledError:
            self._fail(CallFailed(grpc.StatusCode.CANCELLED, "the endpoint closed the stream"))
            raise

    def _hand_out(self, event: rollout_pb2.CallEvent, on_tokens: TokenSink, ended: asyncio.Future) -> None:
        if ended.done():  # its sink failed, or its caller left: nothing more for it
            return
        try:
            for delta in event.message.deltas:  # the last message's too: the tokens that came with the end
                on_tokens(delta.index, list(delta.token_ids), list(delta.logprobs))
        except Exception as exc:  # noqa: BLE001 - the call's own sink failed: that call ends with its error
            ended.set_exception(exc)
            return
        if event.HasField("status"):
            del self._calls[event.call_id]
            ended.set_exception(
                CallFailed(_CODES.get(event.status.code, grpc.StatusCode.UNKNOWN), event.status.message)
            )
        elif event.message.HasField("result"):
            del self._calls[event.call_id]
            ended.set_result(event.message.result)

    def _fail(self, failure: CallFailed) -> None:
        """The stream is over: every call on it fails with `failure`; the next call opens another."""
        if not self.ended:
            self.ended = True
            log.info("multiplexed stream ended", code=failure.code().name, calls=len(self._calls))
        for _, ended in self._calls.values():
            if not ended.done():
                ended.set_exception(failure)
        self._calls.clear()

    async def shut(self) -> None:
        self._reader.cancel()
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def _failure(exc: BaseException) -> CallFailed:
    if isinstance(exc, grpc.aio.AioRpcError):
        return CallFailed(exc.code(), exc.details() or "")
    return CallFailed(grpc.StatusCode.UNAVAILABLE, f"the stream to the replica is closed ({exc})")
