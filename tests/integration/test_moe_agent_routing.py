"""Multi-turn trials of a tiny MoE policy through the real endpoint app, the torch engine in process, with
routing replayed by the trainer: the trajectory's routing fits its tokens and replay makes the trainer's
recomputed logprobs match the ones recorded at generation (docs/moe-routing.md).

The engine flips near ties (tests/unit/models/test_routing.py flip_near_ties), as bf16 rounding does on a
GPU: without replay the trainer's logprobs differ from the engine's; with the recorded routing replayed,
they agree to float32 rounding. The conversations run through sessions of the endpoint app (the openai
client, a session key each), so every turn's prompt rows and sampled rows go through the session record,
the kept path, trial_tokens, trajectory_message and the packed payload, as an agent trial's do.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from dockyard.agents.trajectory import trajectory_message, trial_tokens
from dockyard.api.common.v1 import common_pb2
from dockyard.experience import payload as packed
from dockyard.experience.routing_layout import to_bytes
from dockyard.models.moe import MOE_FAMILIES
from services.endpoint.app import create_app
from services.endpoint.backend import Generated, JobModel
from services.endpoint.rendering import Renderer
from services.endpoint.routing import Replica, Router
from services.endpoint.settings import EndpointSettings
from services.rollout.decoding import decoding_from_proto
from services.rollout.wire import completion_proto
from services.trainer.policy import PolicyTrainer
from services.trainer.requests import training_group
from tests.unit.endpoint.scripted import TOKEN, oa
from tests.unit.models.test_routing import flip_near_ties
from tests.unit.rollout.test_moe_engine import moe_config, moe_engine

TRIALS, TURNS = 4, 3


class EngineBackend:
    """The endpoint's backend with the torch engine in process as its one replica (Generate's reply, built
    by the rollout servicer's own conversion)."""

    def __init__(self, engine, job: JobModel) -> None:
        self.engine, self.job, self.router = engine, job, Router()
        self.asked_routing: list[bool] = []

    async def close(self) -> None: ...

    async def model(self, job_id: str) -> JobModel:
        return self.job

    async def complete(
        self, job_id, session, prompt_ids, n, sampling, images=None, on_tokens=None, *, top_logprobs=0, routing=False
    ) -> Generated:
        self.router.route(session, [Replica("rollout", "127.0.0.1:1")], len(prompt_ids))
        self.asked_routing.append(routing)
        result = await self.engine.generate(
            list(prompt_ids), n, decoding_from_proto(sampling, max_new_tokens_ceiling=64)
        )
        shape = result.routing_shape if routing else None
        completions = [completion_proto(c, routing=result if shape else None) for c in result.completions]
        prompt_routing = to_bytes(result.prompt_routing, shape) if shape is not None else b""
        return Generated(list(result.prompt_token_ids), completions, 0, [0], "rollout", prompt_routing, shape)


async def trial(app, http: httpx.AsyncClient, k: int) -> common_pb2.Trajectory:
    """A TURNS-turn conversation in a session of its own; its recorded trajectory, cut as an agent trial's."""
    opened = (await http.post("/v1/sessions", headers={"x-api-key": TOKEN})).json()
    client = oa(app, key=opened["api_key"])
    messages = [{"role": "user", "content": f"f(1)=3, f(2)={k}, f="}]
    for turn in range(TURNS):
        reply = await client.chat.completions.create(model="job-1", messages=messages, max_tokens=6, seed=10 * k + turn)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}+"}]
    got = await http.get(f"/v1/sessions/{opened['session_id']}/trajectory", headers={"x-api-key": TOKEN})
    document = got.json()
    for segment in document["segments"]:  # every kept position but the last has its row
        assert segment["routing"]
    tokens = trial_tokens(document, max_tokens=4096)
    return trajectory_message(tokens, trajectory_id=f"g/{k}", reward=float(k % 2), valid=True)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_a_multi_turn_trials_routing_matches_the_recorded_logprobs(family: str) -> None:
    config = moe_config(family, "policy.routing_replay=true")
    engine = moe_engine(family, prefix_cache_tokens=2048)  # later turns reuse earlier turns' rows
    flip_near_ties(engine)
    job = JobModel("job-1", Renderer(engine.tokenizer), "hermes", 6, sampling=config.policy.generation, routing=True)
    backend = EngineBackend(engine, job)
    app = create_app(EndpointSettings(max_body_bytes=64 * 1024), TOKEN, backend)

    async def run() -> list[common_pb2.Trajectory]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
        try:
            return [await trial(app, http, k) for k in range(TRIALS)]
        finally:
            await engine.close()

    trajectories = asyncio.run(run())
    assert backend.asked_routing == [True] * (TRIALS * TURNS)
    assert engine.kv_cache_stats.prefill_tokens_saved > 0  # some prompt rows came from the prefix cache
    metadata, payload = packed.split(common_pb2.Group(group_id="g", job_id="job-1", trajectories=trajectories))
    assert payload[3] == packed.VERSION  # routing travels in payload version 2
    group = training_group(metadata, payload)
    for sample in group.samples:
        for segment in sample.segments():
            assert segment.routing.shape[0] == len(segment.prompt_ids) + len(segment.completion_ids) - 1
            assert segment.loss_mask is not None and 0 < sum(segment.loss_mask) < len(segment.completion_ids)
    off = PolicyTrainer(moe_config(family, "policy.record_routing=true")).train_step([group])
    on = PolicyTrainer(config).train_step([group])
    assert 0 < off["routing_mismatch_fraction"] < 1 and 0 < on["routing_mismatch_fraction"] < 1
    assert on["gen_train_logprob_abs_diff"] < 1e-5
    assert off["gen_train_logprob_abs_diff"] > 100 * on["gen_train_logprob_abs_diff"]
    assert np.isfinite(on["loss"])
