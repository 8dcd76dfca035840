"""The rollout service as a real process: load a tiny random policy, generate, refuse bad input, unload, stop."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.rpc.client import connect, health_status
from tests.conftest import expect_code

JOB = "job-rollout-contract"
CEILING = 1024
CONFIG_YAML = """
policy:
  model: {model_type: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,
          num_key_value_heads: 1, intermediate_size: 64, max_position_embeddings: 1024}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  generation: {temperature: 1.0, max_new_tokens: 5}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""
ENV = {"DOCKYARD_ROLLOUT_MAX_NEW_TOKENS_CEILING": str(CEILING), "DOCKYARD_ROLLOUT_NUM_THREADS": "1"}


def sampling(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, **fields})


@pytest.fixture
def rollout(start_service):
    return start_service("rollout", ENV)


def test_rollout_service_contract(rollout) -> None:
    asyncio.run(_contract(rollout.address))
    # The generation whose deadline passed stopped early rather than running to max_new_tokens.
    assert '"generation cancelled"' in rollout.logs(), rollout.logs()[-3000:]
    assert rollout.stop() == 0, rollout.logs()[-3000:]


async def _contract(address: str) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        prompt = "1+2="

        # Nothing loaded yet.
        await expect_code(
            stub.Generate(rollout_pb2.GenerateRequest(job_id=JOB, prompt=prompt, num_samples=1, sampling=sampling())),
            grpc.StatusCode.NOT_FOUND,
            JOB,
        )
        await expect_code(stub.GetEngineInfo(rollout_pb2.GetEngineInfoRequest(job_id=JOB)), grpc.StatusCode.NOT_FOUND)
        await expect_code(stub.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=JOB)), grpc.StatusCode.NOT_FOUND)

        # A config that cannot run is refused, naming the field.
        bad = CONFIG_YAML.replace("temperature: 1.0", "temperature: -1.0")
        await expect_code(
            stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=bad)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy.generation.temperature",
        )
        await expect_code(
            stub.LoadPolicy(
                rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML + "cluster: {device: cuda}\n")
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "cluster.device is cuda but this rollout is deployed on cpu",
        )
        await expect_code(
            stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="", config_yaml=CONFIG_YAML)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "job_id",
        )

        loaded = await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
        assert (loaded.engine, loaded.weight_version) == ("torch", 0)
        again = await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))
        assert again == loaded

        # A group of samples with one logprob per token, stamped with the weight version.
        request = rollout_pb2.GenerateRequest(
            job_id=JOB, request_id="r1", prompt=prompt, num_samples=3, sampling=sampling(seed=4)
        )
        reply = await stub.Generate(request)
        assert list(reply.prompt_token_ids) and len(reply.prompt_token_ids) == len(prompt)
        assert reply.weight_version == 0 and list(reply.weight_versions) == [0]
        assert len(reply.completions) == 3
        for c in reply.completions:
            assert 1 <= len(c.token_ids) <= 8
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)
            assert c.finish_reason in {"eos", "stop", "length"}
        assert await stub.Generate(request) == reply  # same seed, same group

        # No sampling message: the job's policy.generation defaults (max_new_tokens: 5).
        defaults = await stub.Generate(rollout_pb2.GenerateRequest(job_id=JOB, prompt=prompt, num_samples=8))
        lengths = [len(c.token_ids) for c in defaults.completions]
        assert max(lengths) == 5, lengths

        # Bad input: the exact code, a message naming the field, and the server keeps serving.
        bad_requests = [
            (dict(sampling=sampling(temperature=math.nan)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
            (dict(sampling=sampling(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
            (dict(sampling=sampling(max_new_tokens=CEILING + 1)), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
            (dict(sampling=sampling(stop=["€"])), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop"),
            (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (dict(num_samples=0), grpc.StatusCode.INVALID_ARGUMENT, "num_samples"),
            (dict(job_id="no-such-job"), grpc.StatusCode.NOT_FOUND, "no-such-job"),
        ]
        for fields, code, word in bad_requests:
            base = dict(job_id=JOB, prompt=prompt, num_samples=2, sampling=sampling())
            await expect_code(stub.Generate(rollout_pb2.GenerateRequest(**{**base, **fields})), code, word)
        assert await health_status(address) == "SERVING"
        assert len((await stub.Generate(request)).completions) == 3

        # A long generation runs off the event loop: other calls are answered meanwhile.
        long_request = rollout_pb2.GenerateRequest(
            job_id=JOB, prompt=prompt, num_samples=16, sampling=sampling(max_new_tokens=CEILING - 8, ignore_eos=True)
        )
        long_call = asyncio.ensure_future(stub.Generate(long_request))
        await asyncio.sleep(0.5)
        info = await stub.GetEngineInfo(rollout_pb2.GetEngineInfoRequest(job_id=JOB), timeout=10)
        assert not long_call.done(), "generation finished before the concurrent call: make it longer"
        assert all(len(c.token_ids) == CEILING - 8 for c in (await long_call).completions)

        # A caller whose deadline passes mid-generation: the generation stops and frees the engine for the next.
        # The deadline is shorter than the long generation took above (it was still running after 0.5 s).
        await expect_code(stub.Generate(long_request, timeout=0.5), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert len((await stub.Generate(request)).completions) == 3

        assert (info.engine, info.model, info.weight_version) == ("torch", "qwen2", 0)
        assert info.num_parameters > 0

        # The full weight sync runs in tests/integration; here only its refusals.
        await expect_code(
            stub.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(job_id=JOB, weight_version=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "weight_version",
        )
        await expect_code(
            stub.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(job_id="no-such-job", weight_version=1)),
            grpc.StatusCode.NOT_FOUND,
        )

        await stub.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=JOB))
        await expect_code(stub.Generate(request), grpc.StatusCode.NOT_FOUND, JOB)
        await expect_code(stub.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=JOB)), grpc.StatusCode.NOT_FOUND)


def test_generate_takes_text_token_ids_or_messages(rollout) -> None:
    asyncio.run(_prompt_forms(rollout.address))
    assert rollout.stop() == 0, rollout.logs()[-3000:]


async def _prompt_forms(address: str) -> None:
    from dockyard.models.tokenizer import build_char_tokenizer

    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=CONFIG_YAML))

        def generate(**prompt) -> rollout_pb2.GenerateRequest:
            return rollout_pb2.GenerateRequest(job_id=JOB, num_samples=2, sampling=sampling(seed=11), **prompt)

        by_text = await stub.Generate(generate(prompt="1+2="))
        by_ids = await stub.Generate(generate(prompt_token_ids=by_text.prompt_token_ids))
        assert by_ids == by_text  # the same ids, the same seed: the same group

        # A continuation from exact ids: the prompt comes back as sent, never re-tokenized.
        first = by_text.completions[0]
        continued_ids = [*by_text.prompt_token_ids, *first.token_ids, 9, 0]
        continued = await stub.Generate(generate(prompt_token_ids=continued_ids))
        assert list(continued.prompt_token_ids) == continued_ids
        assert all(len(c.logprobs) == len(c.token_ids) >= 1 for c in continued.completions)

        # A conversation goes through the tokenizer's chat template.
        messages = [rollout_pb2.ChatMessage(role="user", content="1+2")]
        chat = await stub.Generate(generate(messages=messages))
        expected = build_char_tokenizer().apply_chat_template(
            [{"role": "user", "content": "1+2"}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(chat.prompt_token_ids) == list(expected)

        vocab = len(build_char_tokenizer())
        for fields, word in [
            (dict(prompt_token_ids=[5, vocab + 1000]), "prompt_token_ids"),
            (dict(prompt_token_ids=[5, -1]), "prompt_token_ids[1]"),
            (dict(prompt="1+2=", prompt_token_ids=[5]), "exactly one of"),
            (dict(prompt_token_ids=[5] * 1020), "context"),
            (dict(messages=[rollout_pb2.ChatMessage(role="", content="x")]), "messages[0].role"),
        ]:
            await expect_code(stub.Generate(generate(**fields)), grpc.StatusCode.INVALID_ARGUMENT, word)
        assert await health_status(address) == "SERVING"
