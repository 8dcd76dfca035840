"""GenerateStream on a real rollout process: tokens arrive step by step, the last message is Generate's reply,
bad input is refused as Generate refuses it, and a caller that goes away stops the generation."""

from __future__ import annotations

import asyncio

import grpc

from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.rpc.client import connect, health_status
from tests.conftest import expect_code
from tests.contract.test_rollout_service import CONFIG_YAML, ENV, JOB, sampling


def test_generate_stream(start_service) -> None:
    rollout = start_service("rollout", {**ENV, "DOCKYARD_ROLLOUT_STREAM_INTERVAL_MS": "0"})  # a message per step
    asyncio.run(_stream(rollout.address))
    # The stream whose caller went away stopped early rather than running to max_new_tokens.
    assert '"generation cancelled"' in rollout.logs(), rollout.logs()[-3000:]
    assert rollout.stop() == 0, rollout.logs()[-3000:]


def stream_request(**fields) -> rollout_pb2.GenerateStreamRequest:
    base = dict(job_id=JOB, prompt="1+2=", num_samples=3, sampling=sampling(seed=5, max_new_tokens=24, ignore_eos=True))
    return rollout_pb2.GenerateStreamRequest(request=rollout_pb2.GenerateRequest(**{**base, **fields}))


async def _stream(address: str) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))

        # Deltas per completion, then the result (with the tokens that came together with the end): each
        # completion is the concatenation of its deltas, and the result is Generate's reply to the same
        # request (same seed, same group).
        request = stream_request()
        messages = [m async for m in stub.GenerateStream(request)]
        *deltas, last = messages
        assert last.HasField("result")
        assert len(deltas) >= 2 and all(m.deltas and not m.HasField("result") for m in deltas)
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[float]] = {}
        for message in messages:
            for d in message.deltas:
                assert len(d.token_ids) == len(d.logprobs) >= 1
                tokens.setdefault(d.index, []).extend(d.token_ids)
                logprobs.setdefault(d.index, []).extend(d.logprobs)
        result = last.result
        assert sorted(tokens) == [0, 1, 2]
        for i, c in enumerate(result.completions):
            assert (tokens[i], logprobs[i]) == (list(c.token_ids), list(c.logprobs))
            assert len(c.token_ids) == 24 and c.finish_reason == "length"
        generated = await stub.Generate(request.request)
        assert list(result.completions) == list(generated.completions)
        assert list(result.prompt_token_ids) == list(generated.prompt_token_ids)
        assert list(result.weight_versions) == list(generated.weight_versions) == [0]

        # Refused exactly as Generate refuses: the code and the field, before any message.
        for fields, code, word in [
            (dict(sampling=sampling(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
            (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (dict(job_id="no-such-job"), grpc.StatusCode.NOT_FOUND, "no-such-job"),
        ]:
            call = stub.GenerateStream(stream_request(**fields))
            await expect_code(_drain(call), code, word)

        # A caller that goes away mid-stream: the generation stops, and the engine serves the next call.
        long_request = stream_request(num_samples=4, sampling=sampling(max_new_tokens=1000, ignore_eos=True))
        call = stub.GenerateStream(long_request)
        seen = 0
        async for message in call:
            seen += sum(len(d.token_ids) for d in message.deltas)
            if seen >= 8:
                break
        call.cancel()
        assert seen < 4 * 1000
        assert await health_status(address) == "SERVING"
        again = [m async for m in stub.GenerateStream(request)]
        assert list(again[-1].result.completions) == list(result.completions)

        # A deadline that passes mid-stream: DEADLINE_EXCEEDED, and the engine serves the next call.
        await expect_code(_drain(stub.GenerateStream(long_request, timeout=0.5)), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert len((await stub.Generate(request.request)).completions) == 3


async def _drain(call) -> list:
    return [m async for m in call]
