"""One GenerateMultiplexed stream: many GenerateStream calls, their messages leaving together.

    requests ──start──> a task per call: run(GenerateStreamRequest, time left, send) ──send(message)──> outbox
             ──cancel──> that call's task cancelled (its generation stops at the engine's next decode step)
    outbox ──one reply per wake-up, at most one per interval──> every event queued since the last reply (a
        decode step shared by the stream's calls: one reply; a call's messages the reply had not taken yet: one
        message); a call's end (a result, a status) goes without waiting out the interval, its first tokens
        with the stream's next reply

Guarantees: each call's events carry the messages GenerateStream would send for its request, in order (those
queued together merged into one: each completion's tokens in order), each in one reply; a call that fails ends
with one event carrying the status GenerateStream would end with (a ServiceError's code; INTERNAL for anything
else, logged) while the stream and its other calls go on; a call id already running, or a cancel of an unknown
one, changes nothing but is logged; a cancelled call sends nothing more. When the caller half-closes, the stream
ends once its running calls have ended; when it goes away, or the stream fails, every running call is
cancelled. Once `drain` is called (the service stops) the stream refuses new calls (UNAVAILABLE) and ends as
soon as none runs, so an idle stream never holds a shutdown back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import structlog

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.rpc.errors import DeadlineExceeded, ServiceError, clip
from services.rollout.wire import merge_into

log = structlog.get_logger()

# Seconds a prepared call may still take (None: no limit); DeadlineExceeded when none is left.
TimeLeft = Callable[[], float | None]
Send = Callable[[rollout_pb2.GenerateStreamResponse], None]
# One call: its messages but the last to `send` as they come (on the loop, never after it returned), the last returned.
Run = Callable[[rollout_pb2.GenerateStreamRequest, TimeLeft, Send], Awaitable[rollout_pb2.GenerateStreamResponse]]


def _status(code: grpc.StatusCode, message: str) -> rollout_pb2.CallStatus:
    return rollout_pb2.CallStatus(code=code.value[0], message=clip(message))


async def wait_out(until: float, event: asyncio.Event) -> None:
    """Until loop time `until`, or sooner once `event` is set."""
    rest = until - asyncio.get_running_loop().time()
    if rest > 0 and not event.is_set():
        try:
            async with asyncio.timeout(rest):
                await event.wait()
        except TimeoutError:
            pass


class MultiplexedStream:
    """The calls of one stream; `run` runs one call (the servicer's GenerateStream, less its context);
    `interval`: seconds a reply waits after the last before it goes, unless it carries a call's end."""

    def __init__(self, run: Run, interval: float = 0.0) -> None:
        self._run_call = run
        self._interval = interval
        self._urgent = asyncio.Event()  # a call's end is queued (or the stream may end): no waiting out the interval
        self._calls: dict[int, asyncio.Task] = {}
        self._outbox: list[rollout_pb2.CallEvent] = []
        self._open: dict[int, rollout_pb2.CallEvent] = {}  # a call's message event still in the outbox
        self._wake = asyncio.Event()
        self._draining = False
        self._reading = True

    def drain(self) -> None:
        """New calls are refused from now on; the stream ends once no call runs."""
        self._draining = True
        self._urgent.set()
        self._wake.set()

    async def serve(
        self, requests: AsyncIterator[rollout_pb2.GenerateMultiplexedRequest]
    ) -> AsyncIterator[rollout_pb2.GenerateMultiplexedResponse]:
        reader = asyncio.ensure_future(self._read(requests))
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    events, self._outbox = self._outbox, []
                    self._open.clear()
                    self._urgent.clear()
                    sent_at = loop.time()
                    yield rollout_pb2.GenerateMultiplexedResponse(events=events)
                    await wait_out(sent_at + self._interval, self._urgent)
                if reader.done():
                    reader.result()  # the request stream's own failure ends this one
                # Events queued while the reply was out (a call's last message) go before the stream ends.
                if not self._calls and not self._outbox and (not self._reading or self._draining):
                    return
        finally:
            reader.cancel()
            for task in self._calls.values():
                task.cancel()

    async def _read(self, requests: AsyncIterator[rollout_pb2.GenerateMultiplexedRequest]) -> None:
        try:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "start":
                    self._start(request)
                elif action == "cancel":
                    task = self._calls.pop(request.call_id, None)
                    if task is None:
                        log.info("multiplexed cancel of no running call", call_id=request.call_id)
                    else:
                        task.cancel()
        finally:
            self._reading = False
            self._urgent.set()
            self._wake.set()

    def _start(self, request: rollout_pb2.GenerateMultiplexedRequest) -> None:
        call_id = request.call_id
        if call_id in self._calls:
            log.warning("multiplexed call id already running: start ignored", call_id=call_id)
            return
        if self._draining:
            self._end(call_id, _status(grpc.StatusCode.UNAVAILABLE, "the replica is shutting down"))
            return
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else None
        task = asyncio.ensure_future(self._run(call_id, request.start, timeout))
        self._calls[call_id] = task
        task.add_done_callback(lambda _: self._forget(call_id, task))

    def _forget(self, call_id: int, task: asyncio.Task) -> None:
        if self._calls.get(call_id) is task:
            del self._calls[call_id]
        self._urgent.set()
        self._wake.set()

    async def _run(self, call_id: int, start: rollout_pb2.GenerateStreamRequest, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def time_left() -> float | None:
            if deadline is None:
                return None
            if (left := deadline - loop.time()) <= 0:
                raise DeadlineExceeded("the call's timeout passed before generation started")
            return left

        task = asyncio.current_task()

        def send(message: rollout_pb2.GenerateStreamResponse) -> None:
            if self._calls.get(call_id) is task:  # a cancelled call sends nothing more
                self._queue(call_id, message)

        try:
            self._queue(call_id, await self._run_call(start, time_left, send))
        except ServiceError as exc:
            self._end(call_id, _status(exc.code, str(exc)))
        except Exception as exc:  # as the server interceptor would: INTERNAL, the cause logged
            log.exception("multiplexed call failed", call_id=call_id)
            self._end(call_id, _status(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _queue(self, call_id: int, message: rollout_pb2.GenerateStreamResponse) -> None:
        if (event := self._open.get(call_id)) is not None:  # the reply has not taken the last one yet
            merge_into(event.message, message)
        else:
            self._open[call_id] = event = rollout_pb2.CallEvent(call_id=call_id, message=message)
            self._outbox.append(event)
        if message.HasField("result"):
            self._urgent.set()
        self._wake.set()

    def _end(self, call_id: int, status: rollout_pb2.CallStatus) -> None:
        self._open.pop(call_id, None)
        self._outbox.append(rollout_pb2.CallEvent(call_id=call_id, status=status))
        self._urgent.set()
        self._wake.set()
