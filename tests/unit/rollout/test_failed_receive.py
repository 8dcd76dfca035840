"""A failed weight receive may leave a replica's weights part old, part new (loads write in place):
the job's Generate and GenerateStream are refused until a receive succeeds, and a generation that a
failed receive overlapped (in-flight updates) is refused at its end, so no token of mixed weights
leaves the replica under a version label."""

from __future__ import annotations

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config_text
from dockyard.rpc.errors import Unavailable
from dockyard.weights.transports import CheckpointTransport
from services.rollout.servicer import RolloutServicer
from services.rollout.settings import RolloutSettings
from tests.unit.rollout.test_stream_coalescing import Context
from tests.unit.rollout.test_torch_engine import PROMPT, tiny_engine

TIMEOUT_S = 0.5  # how long a receive waits for a version that never appears


@pytest.fixture
async def servicer(tmp_path):
    config = (
        "policy: {model: {model_type: qwen2}, train_global_batch_size: 64, generation: {max_new_tokens: 4}}\n"
        f"cluster: {{weight_sync_transport: checkpoint, weight_sync_folder: {tmp_path}}}\n"
    )
    servicer = RolloutServicer(RolloutSettings(weight_sync_timeout_seconds=TIMEOUT_S))
    engine = tiny_engine("cpu", in_flight_weight_updates=True)
    servicer.engines["job"], servicer.configs["job"] = engine, load_config_text(config)
    yield servicer
    await servicer.close()


def generate_request(tokens: int = 4) -> rollout_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=tokens, seed=1, ignore_eos=True)
    return rollout_pb2.GenerateRequest(job_id="job", prompt=PROMPT, num_samples=1, sampling=sampling)


async def receive(servicer: RolloutServicer, version: int) -> rollout_pb2.ReceiveWeightsResponse:
    return await servicer.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(job_id="job", weight_version=version), None)


def publish(servicer: RolloutServicer, folder, version: int) -> None:
    """The trainer's side of the checkpoint transport: the engine's own weights, as version `version`."""
    weights = [(name, t.detach().clone()) for name, t in servicer.engines["job"].named_weights().items()]
    CheckpointTransport(folder, TIMEOUT_S).send(weights, version=version)


async def test_generation_is_refused_after_a_failed_receive_until_one_succeeds(servicer, tmp_path) -> None:
    assert (await servicer.Generate(generate_request(), Context())).weight_version == 0
    with pytest.raises(Unavailable):
        await receive(servicer, 1)  # version 1 never appears
    with pytest.raises(Unavailable, match="receive of weight version 1 failed.*once a ReceiveWeights succeeds"):
        await servicer.Generate(generate_request(), Context())
    stream = servicer.GenerateStream(rollout_pb2.GenerateStreamRequest(request=generate_request()), Context())
    with pytest.raises(Unavailable, match="receive of weight version 1 failed"):
        await anext(stream)
    assert servicer.in_flight == 0

    publish(servicer, tmp_path, 2)
    assert (await receive(servicer, 2)).weight_version == 2
    assert (await servicer.Generate(generate_request(), Context())).weight_version == 2


async def test_a_generation_a_failed_receive_overlapped_is_refused_at_its_end(servicer, tmp_path) -> None:
    publish(servicer, tmp_path, 2)
    request = rollout_pb2.GenerateStreamRequest(request=generate_request(tokens=48))
    stream = servicer.GenerateStream(request, Context())
    first = await anext(stream)
    assert first.deltas and not first.HasField("result")
    # While the stream's rows decode, a receive fails (in-flight updates land between decode steps), then
    # another succeeds: the replica serves new generations again, but this one ran across the failure.
    with pytest.raises(Unavailable):
        await receive(servicer, 1)
    assert (await receive(servicer, 2)).weight_version == 2
    with pytest.raises(Unavailable, match="failed while this generation ran"):
        async for _ in stream:
            pass
    assert (await servicer.Generate(generate_request(), Context())).weight_version == 2
