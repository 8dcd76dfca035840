"""GenerateStream and GenerateMultiplexed through the servicer over the torch engine: steps the reader had not
taken yet come as one message, the tokens that came together with the end ride in the result's message, and
nothing is lost or reordered: every completion's deltas, concatenated, are the unary Generate's token ids and
logprobs."""

from __future__ import annotations

import asyncio

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config_text
from services.rollout.decoding import DecodingParams
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings
from tests.unit.rollout.test_torch_engine import PROMPT, tiny_engine

CONFIG = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64, generation: {max_new_tokens: 4}}\n"
TOKENS = 12


class Context:
    """A caller that stays, without a deadline."""

    def cancelled(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None


def make_servicer(interval_ms: float) -> RolloutServicer:
    servicer = RolloutServicer(RolloutSettings(stream_interval_ms=interval_ms))
    servicer.engines["job"], servicer.configs["job"] = tiny_engine("cpu"), load_config_text(CONFIG)
    return servicer


@pytest.fixture
async def servicer():
    """A message per decode step whenever the reader keeps up (no interval between messages)."""
    servicer = make_servicer(0)
    yield servicer
    await servicer.close()


@pytest.fixture
async def paced():
    """Messages at least 5 s apart: far longer than a whole generation of the tiny engine."""
    servicer = make_servicer(5000)
    yield servicer
    await servicer.close()


def request(seed: int = 3) -> rollout_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=TOKENS, seed=seed, ignore_eos=True)
    return rollout_pb2.GenerateRequest(job_id="job", prompt=PROMPT, num_samples=3, sampling=sampling)


async def run_past_the_stream(servicer: RolloutServicer) -> None:
    """A longer generation run to its end on the same batch: the stream's rows finish meanwhile."""
    longer = DecodingParams(temperature=1.0, max_new_tokens=TOKENS * 2, ignore_eos=True, seed=9)
    await servicer.engines["job"].generate(PROMPT, 1, longer)


async def test_ready_deltas_come_as_one_message_with_the_result_and_nothing_is_lost(servicer) -> None:
    stream = servicer.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request()), Context())
    first = await anext(stream)
    assert first.deltas and not first.HasField("result")
    await run_past_the_stream(servicer)  # the reader is away while the rest of the stream is sampled
    rest = [m async for m in stream]
    # Every step sampled while it was away, and the end: one message.
    assert len(rest) == 1 and rest[0].HasField("result")
    last = rest[0]
    assert {d.index for d in last.deltas} == {0, 1, 2}
    assert all(len(d.token_ids) == len(d.logprobs) >= 2 for d in last.deltas)  # several steps merged
    for i, c in enumerate(last.result.completions):
        deltas = [d for m in (first, last) for d in m.deltas if d.index == i]
        assert [t for d in deltas for t in d.token_ids] == list(c.token_ids)
        assert [lp for d in deltas for lp in d.logprobs] == list(c.logprobs)
        assert len(c.token_ids) == TOKENS
    # The unary Generate samples the same tokens (seeded); it runs alone in the batch, where the stream
    # shared it with the longer generation, so its logprobs agree to float rounding only.
    generated = await servicer.Generate(request(), Context())
    for c, g in zip(last.result.completions, generated.completions, strict=True):
        assert list(c.token_ids) == list(g.token_ids)
        assert list(c.logprobs) == pytest.approx(list(g.logprobs), abs=1e-4)


async def test_a_multiplexed_calls_steps_its_reader_had_not_taken_come_as_one_event(servicer) -> None:
    requests: asyncio.Queue = asyncio.Queue()

    async def incoming():
        while (next_request := await requests.get()) is not None:
            yield next_request

    replies = servicer.GenerateMultiplexed(incoming(), Context())
    start = rollout_pb2.GenerateStreamRequest(request=request())
    requests.put_nowait(rollout_pb2.GenerateMultiplexedRequest(call_id=7, start=start))
    (first,) = (await anext(replies)).events
    assert first.call_id == 7 and first.message.deltas and not first.message.HasField("result")
    await run_past_the_stream(servicer)  # the reader is away while the rest of the call is sampled
    requests.put_nowait(None)  # half-closed: the stream ends with its call
    rest = [event for reply in [r async for r in replies] for event in reply.events]
    # Every step sampled while it was away, and the end: one event, one message.
    assert len(rest) == 1 and rest[0].message.HasField("result")
    last = rest[0].message
    assert all(len(d.token_ids) == len(d.logprobs) >= 2 for d in last.deltas)  # several steps merged
    for i, c in enumerate(last.result.completions):
        deltas = [d for m in (first.message, last) for d in m.deltas if d.index == i]
        assert [t for d in deltas for t in d.token_ids] == list(c.token_ids)
        assert [lp for d in deltas for lp in d.logprobs] == list(c.logprobs)
        assert len(c.token_ids) == TOKENS


async def test_every_token_comes_once_in_order_when_the_reader_keeps_up(servicer) -> None:
    messages = [
        m async for m in servicer.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request(5)), Context())
    ]
    *steps, last = messages
    assert last.HasField("result") and len(steps) >= 2
    assert all(m.deltas and not m.HasField("result") for m in steps)
    generated = await servicer.Generate(request(5), Context())
    for i, c in enumerate(generated.completions):
        ids = [t for m in messages for d in m.deltas if d.index == i for t in d.token_ids]
        lps = [lp for m in messages for d in m.deltas if d.index == i for lp in d.logprobs]
        assert (ids, lps) == (list(c.token_ids), list(c.logprobs))


async def test_a_stream_waits_out_its_interval_but_its_end_goes_at_once(paced) -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    stream = paced.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request(5)), Context())
    messages = [m async for m in stream]
    # The first step at once; every later one waits for the interval, which the end cuts short: one message.
    assert [m.HasField("result") for m in messages] == [False, True]
    assert loop.time() - began < 5.0
    generated = await paced.Generate(request(5), Context())
    for i, c in enumerate(generated.completions):
        assert [t for m in messages for d in m.deltas if d.index == i for t in d.token_ids] == list(c.token_ids)


async def test_a_multiplexed_stream_waits_out_its_interval_but_each_calls_end_goes_at_once(paced) -> None:
    requests: asyncio.Queue = asyncio.Queue()

    async def incoming():
        while (next_request := await requests.get()) is not None:
            yield next_request

    loop = asyncio.get_running_loop()
    began = loop.time()
    replies = paced.GenerateMultiplexed(incoming(), Context())
    for call_id, seed in ((1, 5), (2, 6)):
        start = rollout_pb2.GenerateStreamRequest(request=request(seed))
        requests.put_nowait(rollout_pb2.GenerateMultiplexedRequest(call_id=call_id, start=start))
    requests.put_nowait(None)
    replies = [reply async for reply in replies]
    events = [event for reply in replies for event in reply.events]
    # The first reply at once (the stream was idle), each call's end at once, the steps between wait for
    # them: no interval waited out in full, and a handful of replies for the 2 x 12 steps.
    assert loop.time() - began < 5.0
    assert len(replies) <= 4, [[(e.call_id, e.message.HasField("result")) for e in r.events] for r in replies]
    for call_id, seed in ((1, 5), (2, 6)):
        mine = [e.message for e in events if e.call_id == call_id]
        assert mine[-1].HasField("result") and not any(m.HasField("result") for m in mine[:-1])
        generated = await paced.Generate(request(seed), Context())
        for i, c in enumerate(generated.completions):
            assert [t for m in mine for d in m.deltas if d.index == i for t in d.token_ids] == list(c.token_ids)
