"""GenerateMultiplexed on a real rollout process, driven raw and through the endpoint's MultiplexedCalls: each
call gets GenerateStream's messages, calls that share decode steps share replies, a failed, cancelled or timed
out call ends alone, and a stopping replica ends an idle stream at once rather than after its grace period."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.rpc.client import connect
from services.endpoint.multiplex import CallFailed, MultiplexedCalls
from tests.contract.test_rollout_service import CONFIG_YAML, ENV, JOB, sampling
from tests.contract.test_rollout_stream import stream_request


def start(call_id: int, request: rollout_pb2.GenerateStreamRequest, timeout: float = 0.0):
    return rollout_pb2.GenerateMultiplexedRequest(call_id=call_id, start=request, timeout_seconds=timeout)


def cancel(call_id: int):
    return rollout_pb2.GenerateMultiplexedRequest(call_id=call_id, cancel=rollout_pb2.GenerateMultiplexedCancel())


class RawStream:
    """One GenerateMultiplexed call, its replies read into per-call event lists by a background task."""

    def __init__(self, stub) -> None:
        self.call = stub.GenerateMultiplexed(timeout=120)
        self.events: dict[int, list[rollout_pb2.CallEvent]] = {}
        self.replies: list[set[int]] = []  # the calls each reply carried events of
        self.ended = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            while (reply := await self.call.read()) is not grpc.aio.EOF:
                self.replies.append({e.call_id for e in reply.events})
                for event in reply.events:
                    self.events.setdefault(event.call_id, []).append(event)
        finally:
            self.ended.set()

    def done(self, call_id: int) -> bool:
        last = self.events.get(call_id, [None])[-1]
        return last is not None and (last.HasField("status") or last.message.HasField("result"))

    async def wait(self, *call_ids: int, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while not all(self.done(c) for c in call_ids):
                await asyncio.sleep(0.01)


def tokens_of(events: list[rollout_pb2.CallEvent]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for event in events:
        for d in event.message.deltas:
            tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens


def test_multiplexed_calls(start_service) -> None:
    rollout = start_service("rollout", ENV)
    asyncio.run(_multiplexed(rollout.address, lambda: rollout.logs().count('"generation cancelled"')))
    # The cancelled call stopped early rather than running to its max_new_tokens.
    assert '"generation cancelled"' in rollout.logs(), rollout.logs()[-3000:]
    assert rollout.stop() == 0, rollout.logs()[-3000:]


async def _multiplexed(address: str, cancellations) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
        stream = RawStream(stub)

        # Four calls at once, each its own seed: each call's events are GenerateStream's messages for its
        # request (its seed's tokens, as GenerateStream samples them alone; logprobs equal up to the float
        # rounding of a batch of another size), and calls that decode together share replies.
        requests = {i: stream_request(sampling=sampling(seed=i, max_new_tokens=24, ignore_eos=True)) for i in range(4)}
        for i, request in requests.items():
            await stream.call.write(start(i, request))
        await stream.wait(*requests)
        for i, request in requests.items():
            events = stream.events[i]
            alone = [m async for m in stub.GenerateStream(request)]
            result, expected = events[-1].message.result, alone[-1].result
            assert [list(c.token_ids) for c in result.completions] == [list(c.token_ids) for c in expected.completions]
            for got, want in zip(result.completions, expected.completions, strict=True):
                assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-4)
            assert tokens_of(events) == {d: list(c.token_ids) for d, c in enumerate(result.completions)}
            assert all(not e.HasField("status") for e in events)
        assert any(len(calls) > 1 for calls in stream.replies), stream.replies

        # A bad call, an unknown job and a call past its timeout end alone, each with GenerateStream's status,
        # while a good call on the same stream completes; then a cancelled call sends nothing more.
        await stream.call.write(start(10, stream_request(sampling=sampling(top_p=1.5))))
        await stream.call.write(start(11, stream_request(job_id="no-such-job")))
        long = stream_request(num_samples=4, sampling=sampling(max_new_tokens=1000, ignore_eos=True))
        await stream.call.write(start(12, long, timeout=0.5))
        await stream.call.write(start(13, requests[0]))
        await stream.wait(10, 11, 12, 13)
        for call_id, code, word in [
            (10, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
            (11, grpc.StatusCode.NOT_FOUND, "no-such-job"),
            (12, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
        ]:
            status = stream.events[call_id][-1].status
            assert status.code == code.value[0] and word in status.message, (call_id, status)
        assert tokens_of(stream.events[13]) == tokens_of(stream.events[0])

        await stream.call.write(start(20, long))
        async with asyncio.timeout(60):
            while sum(len(t) for t in tokens_of(stream.events.get(20, [])).values()) < 8:
                await asyncio.sleep(0.01)
        await stream.call.write(cancel(20))
        await stream.call.write(start(21, requests[1]))
        await stream.wait(21)  # whatever call 20 sent before its cancel came ahead of call 21's end
        seen = len(stream.events[20])
        await stream.call.write(start(22, requests[3]))
        await stream.wait(22)
        assert len(stream.events[20]) == seen and not stream.done(20)

        # Half-closed by the caller: the stream ends once its running call has ended.
        await stream.call.write(start(30, requests[2]))
        await stream.call.done_writing()
        async with asyncio.timeout(60):
            await stream.ended.wait()
        assert stream.done(30) and await stream.call.code() == grpc.StatusCode.OK
        await stream.reader

        # The endpoint's side: concurrent calls over one shared stream, tokens as they come.
        calls = MultiplexedCalls(stub)
        seen_tokens: dict[int, dict[int, list[int]]] = {i: {} for i in range(3)}

        async def one(i: int) -> rollout_pb2.GenerateResponse:
            sink = lambda index, ids, logprobs: seen_tokens[i].setdefault(index, []).extend(ids)  # noqa: E731
            return await calls.stream(requests[i].request, sink, timeout=60)

        results = await asyncio.gather(*(one(i) for i in range(3)))
        for i, result in enumerate(results):
            assert [list(c.token_ids) for c in result.completions] == list(tokens_of(stream.events[i]).values())
            assert seen_tokens[i] == {d: list(c.token_ids) for d, c in enumerate(result.completions)}
        with pytest.raises(CallFailed) as failed:
            await calls.stream(stream_request(prompt="").request, lambda *_: None, timeout=60)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in failed.value.details()
        # A caller that goes away cancels its call on the replica; the stream serves the next one.
        got: list[int] = []
        leaving = asyncio.ensure_future(calls.stream(long.request, lambda _, ids, __: got.extend(ids), timeout=60))
        async with asyncio.timeout(60):  # it is generating (far from its 1,000 tokens) when its caller leaves
            while not got:
                await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert list((await one(0)).completions[0].token_ids) == list(results[0].completions[0].token_ids)
        with pytest.raises(CallFailed) as failed:
            await calls.stream(long.request, lambda *_: None, timeout=0.5)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A sink that fails ends its call with its error, hears nothing more, and the replica stops the call.
        heard = []

        def failing(index: int, ids: list[int], logprobs: list[float]) -> None:
            heard.append(ids)
            raise ValueError("the sink broke")

        await asyncio.sleep(0.5)  # the cancels sent before have landed
        before = cancellations()
        with pytest.raises(ValueError, match="the sink broke"):
            await calls.stream(long.request, failing, timeout=60)
        assert list((await one(1)).completions[0].token_ids) == list(results[1].completions[0].token_ids)
        assert len(heard) == 1
        async with asyncio.timeout(30):  # and the replica stopped that call long before its 1,000 tokens
            while cancellations() == before:
                await asyncio.sleep(0.05)
        await calls.close()


def test_a_stopping_replica_ends_an_idle_stream_at_once(start_service) -> None:
    grace = 20.0
    rollout = start_service("rollout", {**ENV, "DOCKYARD_ROLLOUT_SHUTDOWN_GRACE_SECONDS": str(grace)})

    async def run() -> float:
        async with connect(rollout.address, default_timeout=120) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
            calls = MultiplexedCalls(stub)
            await calls.stream(stream_request().request, lambda *_: None, timeout=60)  # the stream is open, idle
            began = time.monotonic()
            rollout.proc.terminate()
            with pytest.raises(CallFailed) as failed:  # the replica ended the stream: the next call is told so
                async with asyncio.timeout(grace):
                    while True:
                        await calls.stream(stream_request().request, lambda *_: None, timeout=60)
                        await asyncio.sleep(0.1)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
            await calls.close()
            return began

    began = asyncio.run(run())
    assert rollout.proc.wait(grace) == 0
    assert time.monotonic() - began < grace / 2, rollout.logs()[-3000:]
