"""backend=sglang through the real rollout service on a replica without SGLang: FAILED_PRECONDITION naming it.

This machine cannot install SGLang (sglang 0.5.23 pins another torch and needs
CUDA kernels and a GPU), so this is the SGLang path a real service process
takes here: the job's LoadPolicy is refused with what to install, nothing is
loaded, and the replica keeps serving other jobs.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import yaml

from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.models import build_char_tokenizer
from dockyard.rpc.client import connect
from tests.conftest import expect_code, missing

JOB = "job-rollout-sglang"
TORCH_CONFIG = {
    "policy": {
        "model": {
            "model_type": "qwen2",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "max_position_embeddings": 1024,
        },
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "generation": {"temperature": 1.0, "max_new_tokens": 5},
    },
    "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
}
ENV = {"DOCKYARD_ROLLOUT_NUM_THREADS": "1"}


def _sglang_config(model_dir: str) -> str:
    return yaml.safe_dump(
        {
            "policy": {
                "model_name": model_dir,
                "train_global_batch_size": 4,
                "train_micro_batch_size": 2,
                "generation": {"backend": "sglang", "sglang_cfg": {"mem_fraction_static": 0.5}},
            },
            "cluster": {"device": "cpu"},  # where this replica runs; SGLang is missing whatever the device
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        }
    )


def test_sglang_backend_without_sglang_is_failed_precondition(start_service, tmp_path) -> None:
    if importlib.util.find_spec("sglang") is not None:
        missing("sglang is installed here: this test covers replicas without it")
    build_char_tokenizer().save_pretrained(tmp_path / "model")
    rollout = start_service("rollout", ENV)

    async def scenario() -> None:
        async with connect(rollout.address, default_timeout=120) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            request = rollout_pb2.LoadPolicyRequest(job_id=JOB, config_yaml=_sglang_config(str(tmp_path / "model")))
            await expect_code(stub.LoadPolicy(request), grpc.StatusCode.FAILED_PRECONDITION, "sglang", "pip install")
            # Nothing was loaded for the job, and the replica still serves another engine.
            await expect_code(
                stub.GetEngineInfo(rollout_pb2.GetEngineInfoRequest(job_id=JOB)), grpc.StatusCode.NOT_FOUND
            )
            torch_job = rollout_pb2.LoadPolicyRequest(job_id=f"{JOB}-torch", config_yaml=yaml.safe_dump(TORCH_CONFIG))
            assert (await stub.LoadPolicy(torch_job)).engine == "torch"

    asyncio.run(scenario())
    assert rollout.stop() == 0, rollout.logs()[-3000:]
