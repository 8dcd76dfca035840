"""TrainerService on real servers (trainer + buffer): load, step, ack, checkpoint, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import torch
from transformers import AutoModelForCausalLM

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.api.trainer.v1 import trainer_pb2 as pb
from dockyard.api.trainer.v1 import trainer_pb2_grpc
from dockyard.models.tokenizer import build_char_tokenizer
from dockyard.rpc.client import connect
from tests.conftest import REPO_ROOT, ServiceProcess, expect_code, free_port

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
        # A job for a GPU is refused by a trainer deployed on the CPU, naming both settings.
        await expect_code(
            stub.LoadPolicy(pb.LoadPolicyRequest(job_id="job", config_yaml=config + "cluster: {device: cuda}\n")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "cluster.device is cuda but this trainer is deployed on cpu",
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


async def test_bad_batches_are_refused_and_the_trainer_keeps_training(start_service, tmp_path: Path) -> None:
    buffer = start_service("buffer")
    trainer = start_service("trainer", {"DOCKYARD_TRAINER_BUFFER_ADDRESS": buffer.address})
    config = CONFIG.replace("LOG_DIR", str(tmp_path))
    async with connect(trainer.address) as tc, connect(buffer.address) as bc:
        stub, buf = trainer_pb2_grpc.TrainerServiceStub(tc), buffer_pb2_grpc.BufferServiceStub(bc)
        await stub.LoadPolicy(pb.LoadPolicyRequest(job_id="job", config_yaml=config))
        await buf.OpenJob(buffer_pb2.OpenJobRequest(job_id="job", max_groups=4, max_trajectory_age_steps=0))

        nan_reward = group("nan", 0)
        nan_reward.trajectories[2].reward = float("nan")
        out_of_vocab = group("vocab", 0)
        out_of_vocab.trajectories[0].completion_token_ids[0] = 100_000
        empty = group("empty", 0)
        for t in empty.trajectories:
            del t.completion_token_ids[:], t.completion_logprobs[:]
        # The buffer refuses what it can check itself; the trainer never sees it.
        await expect_code(
            buf.PutGroup(buffer_pb2.PutGroupRequest(group=nan_reward)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "'nan'",
            "trajectories[2]",
            "reward",
        )
        for bad, words in [
            (out_of_vocab, ["token id 100000", "vocabulary"]),
            (empty, ["empty batch"]),
        ]:
            await buf.PutGroup(buffer_pb2.PutGroupRequest(group=bad))
            await expect_code(
                stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1)), grpc.StatusCode.INVALID_ARGUMENT, *words
            )
        stats = await buf.GetStats(buffer_pb2.GetStatsRequest(job_id="job"))
        assert (stats.pending, stats.held) == (0, 0)  # refused batches do not come back
        assert stats.latest_version == 0  # acked at the unchanged version: nothing was trained

        # The same service trains the next good batch as step 1.
        await buf.PutGroup(buffer_pb2.PutGroupRequest(group=group("good", 0)))
        reply = await stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1))
        assert reply.weight_version == 1 and reply.metrics["num_tokens"] > 0

        # Supervised steps: the same refusals, then a step.
        demo = pb.Demonstration(prompt="f(1)=2 f(x)=", completion="2*x")
        await expect_code(
            stub.SupervisedStep(pb.SupervisedStepRequest(job_id="job", step=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "no demonstrations",
        )
        await expect_code(
            stub.SupervisedStep(
                pb.SupervisedStepRequest(job_id="job", step=2, demonstrations=[demo, pb.Demonstration(prompt="x")])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "demonstrations[1]",
        )
        await expect_code(
            stub.SupervisedStep(pb.SupervisedStepRequest(job_id="job", step=5, demonstrations=[demo])),
            grpc.StatusCode.FAILED_PRECONDITION,
            "next step is 2",
        )
        sft = await stub.SupervisedStep(pb.SupervisedStepRequest(job_id="job", step=2, demonstrations=[demo]))
        assert sft.weight_version == 2 and sft.metrics["num_tokens"] == 4  # "2*x" + <eos>
    assert trainer.stop() == 0


class TorchrunTrainer(ServiceProcess):
    """The trainer service as torchrun starts it on a node: 2 ranks, rank 0 serving gRPC."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.name = "trainer"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "services.trainer"]
        full_env = {**os.environ, **env, "DOCKYARD_TRAINER_PORT": str(self.port), "OMP_NUM_THREADS": "1"}
        full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)


async def test_two_rank_trainer_serves_steps_and_checkpoints(start_service, tmp_path: Path) -> None:
    from dockyard.config import load_config_text
    from services.trainer.policy import PolicyTrainer
    from services.trainer.requests import training_group

    buffer = start_service("buffer")
    trainer = TorchrunTrainer({"DOCKYARD_TRAINER_BUFFER_ADDRESS": buffer.address}, tmp_path / "trainer.log")
    try:
        trainer.wait_serving(120)
        config = CONFIG.replace("LOG_DIR", str(tmp_path))
        async with connect(trainer.address) as tc, connect(buffer.address) as bc:
            stub, buf = trainer_pb2_grpc.TrainerServiceStub(tc), buffer_pb2_grpc.BufferServiceStub(bc)
            loaded = await stub.LoadPolicy(pb.LoadPolicyRequest(job_id="job", config_yaml=config))
            await buf.OpenJob(buffer_pb2.OpenJobRequest(job_id="job", max_groups=4, max_trajectory_age_steps=0))
            await buf.PutGroup(buffer_pb2.PutGroupRequest(group=group("g0", 0)))
            reply = await stub.TrainStep(pb.TrainStepRequest(job_id="job", step=1))
            saved = await stub.SaveCheckpoint(pb.SaveCheckpointRequest(job_id="job", metrics={"pass_rate": 0.25}))
            await stub.UnloadPolicy(pb.UnloadPolicyRequest(job_id="job"))
    finally:
        trainer.stop()

    # The sharded service took exactly the single-rank step on the same group.
    local = PolicyTrainer(load_config_text(config))
    assert local.num_parameters() == loaded.num_parameters
    expected = local.train_step([training_group(group("g0", 0))])
    assert reply.weight_version == 1
    assert abs(reply.metrics["loss"] - expected["loss"]) < 1e-5
    assert abs(reply.metrics["grad_norm"] - expected["grad_norm"]) < 1e-4 * expected["grad_norm"]
    model = AutoModelForCausalLM.from_pretrained(saved.path)
    for (name, mine), (_, theirs) in zip(local.named_weights(), model.named_parameters(), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5, msg=name)
