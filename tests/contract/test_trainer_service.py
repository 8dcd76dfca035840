"""TrainerService on real servers (trainer + buffer): load, step, ack, checkpoint, refusals."""

from __future__ import annotations

from pathlib import Path

import grpc
from transformers import AutoModelForCausalLM

from dockyard.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.common.v1 import common_pb2
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.rpc.client import connect
from dockyard.trainer.v1 import trainer_pb2 as pb
from dockyard.trainer.v1 import trainer_pb2_grpc
from tests.conftest import expect_code

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1}
  train_global_batch_size: 4
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4, max_trajectory_age_steps: 0}
logger: {log_dir: LOG_DIR}
"""


def group(group_id: str, version: int) -> common_pb2.Group:
    tok = build_char_tokenizer()
    prompt = tok("f(1)=2 f(x)=")["input_ids"]
    trajectories = []
    for i, (text, reward) in enumerate([("2*x", 1.0), ("x+1", 1.0), ("x", 0.0), ("7", 0.0)]):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        trajectories.append(
            common_pb2.Trajectory(
                trajectory_id=f"{group_id}/{i}",
                prompt_token_ids=prompt,
                completion_token_ids=ids,
                completion_logprobs=[-2.0] * len(ids),
                weight_version=version,
                reward=reward,
                valid=True,
            )
        )
    return common_pb2.Group(group_id=group_id, job_id="job", weight_version=version, trajectories=trajectories)


async def test_train_step_consumes_and_acks_fresh_groups(start_service, tmp_path: Path) -> None:
    buffer = start_service("buffer")
    trainer = start_service("trainer", {"DOCKYARD_TRAINER_BUFFER_ADDRESS": buffer.address})
    config = CONFIG.replace("LOG_DIR", str(tmp_path))
    async with connect(trainer.address) as tc, connect(buffer.address) as bc:
        stub, buf = trainer_pb2_grpc.TrainerServiceStub(tc), buffer_pb2_grpc.BufferServiceStub(bc)
        await expect_code(
            stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1)), grpc.StatusCode.NOT_FOUND, "LoadPolicy"
        )
        await expect_code(
            stub.LoadPolicy(pb.LoadPolicyRequest(config_yaml=config)), grpc.StatusCode.INVALID_ARGUMENT, "job_id"
        )
        await expect_code(
            stub.LoadPolicy(
                pb.LoadPolicyRequest(job_id="job", config_yaml=config.replace("hidden_size: 32", "hidden_size: -1"))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy.model",
        )
        await expect_code(
            stub.LoadPolicy(pb.LoadPolicyRequest(job_id="job", config_yaml="policy: {model_name: /no/such/model}")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "/no/such/model",
        )

        loaded = await stub.LoadPolicy(pb.LoadPolicyRequest(job_id="job", config_yaml=config))
        assert loaded.weight_version == 0 and loaded.num_parameters > 0
        # The coordinator opens the job on the buffer; until then the trainer says so.
        await expect_code(
            stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1)), grpc.StatusCode.FAILED_PRECONDITION, "OpenJob"
        )
        await buf.OpenJob(buffer_pb2.OpenJobRequest(job_id="job", max_groups=4, max_trajectory_age_steps=0))
        await expect_code(
            stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no fresh groups",
        )
        await expect_code(
            stub.TrainStep(pb.TrainStepRequest(job_id="job", step=2)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "next step is 1",
        )

        await buf.PutGroup(buffer_pb2.PutGroupRequest(group=group("g0", 0)))
        reply = await stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1))
        assert (reply.weight_version, reply.groups_trained, reply.trajectories_trained) == (1, 1, 4)
        assert reply.metrics["grad_norm"] > 0 and reply.metrics["reward_mean"] == 0.5
        stats = await buf.GetStats(buffer_pb2.GetStatsRequest(job_id="job"))
        assert (stats.acked, stats.pending, stats.held) == (1, 0, 0)

        assert stats.latest_version == 1  # the ack carried the trainer's new version

        # With max_trajectory_age_steps 0, a version-0 group is stale once the trainer is at 1.
        assert (await buf.PutGroup(buffer_pb2.PutGroupRequest(group=group("g1", 0)))).dropped_stale
        await expect_code(
            stub.TrainStep(pb.TrainStepRequest(job_id="job", step=2)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no fresh groups",
        )

        saved = await stub.SaveCheckpoint(pb.SaveCheckpointRequest(job_id="job"))
        assert saved.step == 1 and saved.path.endswith("job/checkpoints/step-1")
        assert AutoModelForCausalLM.from_pretrained(saved.path).num_parameters() == loaded.num_parameters

        await stub.UnloadPolicy(pb.UnloadPolicyRequest(job_id="job"))
        await expect_code(stub.UnloadPolicy(pb.UnloadPolicyRequest(job_id="job")), grpc.StatusCode.NOT_FOUND)
    assert trainer.stop() == 0
