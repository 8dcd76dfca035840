"""MultiplexedStream with scripted calls: when a stream ends, nothing its calls queued is left behind."""

from __future__ import annotations

import asyncio

from dockyard.api.rollout.v1 import rollout_pb2
from services.rollout.multiplex import MultiplexedStream


def step(token: int) -> rollout_pb2.GenerateStreamResponse:
    return rollout_pb2.GenerateStreamResponse(deltas=[rollout_pb2.CompletionDelta(index=0, token_ids=[token])])


def last(token: int) -> rollout_pb2.GenerateStreamResponse:
    message = step(token)
    message.result.completions.add(token_ids=[token])
    return message


async def test_a_last_message_queued_while_a_reply_was_out_goes_before_the_half_closed_stream_ends() -> None:
    finish = asyncio.Event()

    async def run(request, time_left, send) -> rollout_pb2.GenerateStreamResponse:
        send(step(1))
        await finish.wait()
        return last(2)

    async def requests():
        yield rollout_pb2.GenerateMultiplexedRequest(call_id=5, start=rollout_pb2.GenerateStreamRequest())

    replies = MultiplexedStream(run).serve(requests())
    (first,) = (await anext(replies)).events  # the stream is held at this reply: the caller has not read on
    assert first.call_id == 5 and not first.message.HasField("result")
    finish.set()  # meanwhile the call ends (its last message queued, its task done) and the caller half-closed
    for _ in range(5):
        await asyncio.sleep(0)
    rest = [event for reply in [r async for r in replies] for event in reply.events]
    assert [(e.call_id, e.message.HasField("result")) for e in rest] == [(5, True)]
    assert list(rest[0].message.result.completions[0].token_ids) == [2]


async def test_a_call_refused_while_draining_is_told_before_the_stream_ends() -> None:
    finish = asyncio.Event()
    started: list[int] = []

    async def run(request, time_left, send) -> rollout_pb2.GenerateStreamResponse:
        started.append(request.request.num_samples)
        await finish.wait()
        return last(3)

    stream = MultiplexedStream(run)
    incoming: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (request := await incoming.get()) is not None:
            yield request

    def start(call_id: int) -> rollout_pb2.GenerateMultiplexedRequest:
        call = rollout_pb2.GenerateStreamRequest(request=rollout_pb2.GenerateRequest(num_samples=call_id))
        return rollout_pb2.GenerateMultiplexedRequest(call_id=call_id, start=call)

    async def read() -> list[rollout_pb2.CallEvent]:
        return [event async for reply in stream.serve(requests()) for event in reply.events]

    reader = asyncio.ensure_future(read())
    incoming.put_nowait(start(1))
    while not started:
        await asyncio.sleep(0)
    stream.drain()  # the service stops while call 1 runs: a call that comes now is refused
    incoming.put_nowait(start(8))
    for _ in range(5):
        await asyncio.sleep(0)
    finish.set()  # call 1 ends: the stream ends after its last message and call 8's refusal
    events = await asyncio.wait_for(reader, 10)
    assert started == [1]
    assert sorted((e.call_id, e.status.message, e.message.HasField("result")) for e in events) == [
        (1, "", True),
        (8, "the replica is shutting down", False),
    ]
