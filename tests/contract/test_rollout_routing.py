"""GenerateRequest.return_routing on a real rollout process: a mixture-of-experts policy's routing comes back
(Generate and GenerateStream) or is staged with the payload, one row per position but the last, and a dense
policy's reply carries none."""

from __future__ import annotations

import asyncio

import numpy as np
import redis
import yaml

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.experience import payload, single_turn
from dockyard.experience.routing_layout import from_bytes
from dockyard.models.moe import TINY_MOE
from dockyard.rpc.client import connect
from tests.contract.test_rollout_service import CONFIG_YAML, ENV, sampling
from tests.contract.test_rollout_staging import plane

MOE_JOB = "job-rollout-moe"
DENSE_JOB = "job-rollout-dense"
GROUP = f"{MOE_JOB}/s1/g0"
MOE_YAML = yaml.safe_dump(
    {
        "policy": {
            "model": TINY_MOE["qwen3_moe"],
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "generation": {"temperature": 1.0, "max_new_tokens": 5},
        },
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
    }
)


def request(job: str, staging: rollout_pb2.PayloadStaging | None = None) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        job_id=job,
        prompt="1+2=",
        num_samples=2,
        sampling=sampling(seed=7, max_new_tokens=6, ignore_eos=True),
        staging=staging,
        return_routing=True,
    )


def test_routing_comes_back_with_the_tokens_or_in_the_staged_payload(start_service, redis_server: str) -> None:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    rollout = start_service("rollout", ENV)
    asyncio.run(_routing(rollout.address, redis_server, client))
    assert rollout.stop() == 0


async def _routing(address: str, url: str, client: redis.Redis) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=MOE_JOB, config_yaml=MOE_YAML))
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=DENSE_JOB, config_yaml=CONFIG_YAML))

        reply = await stub.Generate(request(MOE_JOB))
        assert (reply.routing_shape.moe_layers, reply.routing_shape.top_k, reply.routing_shape.num_experts) == (2, 2, 8)
        shape = payload.shape_of(reply.routing_shape)
        assert len(from_bytes(reply.prompt_routing, shape)) == len(reply.prompt_token_ids)
        for c in reply.completions:
            assert len(from_bytes(c.routing, shape)) == len(c.token_ids) - 1 and not c.prompt_routing
        arrays = single_turn.reply_trajectories(GROUP, reply)
        for trajectory, c in zip(arrays, reply.completions, strict=True):
            assert trajectory.routing == reply.prompt_routing + c.routing

        # The same seeded generation staged: the payload holds the same routing, merged back field for field.
        staged = await stub.Generate(
            request(MOE_JOB, rollout_pb2.PayloadStaging(data_plane=plane(url), group_id=GROUP))
        )
        assert staged.payload_key and not staged.prompt_routing and all(not c.routing for c in staged.completions)
        stored = client.get(staged.payload_key)
        assert stored[3] == 2  # payload version 2: it carries routing
        metadata = common_pb2.Group(group_id=GROUP, trajectories=single_turn.reply_trajectories(GROUP, staged))
        merged = payload.merge(metadata, stored)
        assert [t.routing for t in merged.trajectories] == [t.routing for t in arrays]
        assert all(t.routing_shape == reply.routing_shape for t in merged.trajectories)

        # Streamed: the last message's result carries the routing too.
        stream = stub.GenerateStream(rollout_pb2.GenerateStreamRequest(request=request(MOE_JOB)))
        last = [m async for m in stream][-1].result
        assert last.prompt_routing == reply.prompt_routing
        assert [c.routing for c in last.completions] == [c.routing for c in reply.completions]

        # Not asked: none; a dense policy: none either, and no shape.
        plain = request(MOE_JOB)
        plain.return_routing = False
        unasked = await stub.Generate(plain)
        assert not unasked.HasField("routing_shape") and all(not c.routing for c in unasked.completions)
        dense = await stub.Generate(request(DENSE_JOB))
        assert not dense.HasField("routing_shape") and not dense.prompt_routing
        assert np.array_equal([c.num_tokens for c in dense.completions], [6, 6])
