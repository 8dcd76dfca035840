"""The whole-tensor weight sync between a real trainer service and a real rollout service serving an SGLang job.

SGLang cannot be installed here (sglang 0.5.23 pins torch 2.14.1 and needs
CUDA kernels and a GPU), so the rollout service imports the stand-in `sglang`
of tests/fixtures/sglang_stand_in (put on its PYTHONPATH). Everything else is
real and in its own process: the trainer service (PushWeights -> its
WeightSynchronizer -> transport_for -> WholeTensorTransport, rank 0 hosting
the TCPStore and forming its group with torch's `_new_process_group_helper`),
the rollout service (ReceiveWeights -> SglangEngine -> the stand-in's
tokenizer manager, which joins with a tcp:// rendezvous and the same torch
helper, as SGLang's `init_custom_process_group` does, and receives every
tensor with `torch.distributed.broadcast` over gloo). The coordinator is played
by this test: a gRPC server that hands both members their weight-sync group
(and can hand them different secrets).

What a stand-in cannot show: that SGLang's own model loads these names
(`load_weights` maps Hugging Face names onto SGLang's fused layout; the stand-in
checks names and shapes against the Hugging Face model instead), NCCL between
a trainer GPU and SGLang's scheduler, and that SGLang's torch (2.14) lays out
the group's store keys as this torch does.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from safetensors.torch import load_file

from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2 as cpb
from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.models import build_char_tokenizer, build_random_model
from dockyard.rpc.client import connect
from tests.conftest import REPO_ROOT, dead_address, expect_code, free_port

pytestmark = pytest.mark.slow

STAND_IN = REPO_ROOT / "tests" / "fixtures" / "sglang_stand_in"
# Several 1 MiB buckets: each MLP matrix is 512 KiB in float32.
TINY = {"hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4}


class Coordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """The coordinator's part in a weight sync: each job's group (a new epoch and port after a reported failure)."""

    def __init__(self) -> None:
        self.epochs: dict[str, int] = {}
        self.ports: dict[str, int] = {}
        self.secrets: dict[tuple[str, str], str] = {}  # (job, member) -> a secret other than the job's

    def GetWeightSyncGroup(self, request, context):
        job = request.job_id
        if request.HasField("failed_epoch") and request.failed_epoch == self.epochs.get(job):
            self.epochs[job] += 1
            self.ports[job] = free_port()
        self.epochs.setdefault(job, 0)
        port = self.ports.setdefault(job, free_port())
        secret = self.secrets.get((job, request.member), f"secret-of-{job}")
        group = common_pb2.WeightSyncGroup(
            master_address="127.0.0.1",
            master_port=port,
            world_size=2,
            epoch=self.epochs[job],
            backend="gloo",
            secret=secret,
        )
        return cpb.GetWeightSyncGroupResponse(group=group, rank=0 if request.member == "trainer" else 1)

    def RegisterMember(self, request, context):
        return cpb.RegisterMemberResponse(heartbeat_seconds=2.0)

    def Heartbeat(self, request, context):
        return cpb.HeartbeatResponse()

    def UnregisterMember(self, request, context):
        return cpb.UnregisterMemberResponse()


@pytest.fixture
def coordinator():
    servicer = Coordinator()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def _model_folder(tmp_path: Path) -> Path:
    tokenizer = build_char_tokenizer()
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    folder = tmp_path / "model"
    build_random_model(TINY, len(tokenizer), seed=3, **ids).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _job_config(folder: Path, bucket_mb: int = 256, **sglang_cfg) -> str:
    return yaml.safe_dump(
        {
            "policy": {
                "model_name": str(folder),
                "dtype": "float32",
                "train_global_batch_size": 4,
                "train_micro_batch_size": 2,
                "generation": {"backend": "sglang", "sglang_cfg": sglang_cfg},
            },
            "cluster": {"weight_sync_backend": "gloo", "weight_sync_bucket_mb": bucket_mb},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
        }
    )


def test_trainer_pushes_whole_tensors_to_an_sglang_replica(start_service, coordinator, tmp_path) -> None:
    fake, address = coordinator
    fake.secrets[("job-secret", "rollout")] = "not-the-trainers"
    folder = _model_folder(tmp_path)
    record = tmp_path / "received"
    trainer = start_service(
        "trainer",
        {
            "DOCKYARD_TRAINER_COORDINATOR_ADDRESS": address,
            "DOCKYARD_TRAINER_BUFFER_ADDRESS": dead_address(),  # never called: no training here
            "DOCKYARD_TRAINER_WEIGHT_SYNC_TIMEOUT_SECONDS": "30",
            "DOCKYARD_TRAINER_NUM_THREADS": "1",
        },
    )
    rollout = start_service(
        "rollout",
        {
            "DOCKYARD_ROLLOUT_COORDINATOR_ADDRESS": address,
            "DOCKYARD_ROLLOUT_WEIGHT_SYNC_TIMEOUT_SECONDS": "30",
            "DOCKYARD_ROLLOUT_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(STAND_IN), os.environ.get("PYTHONPATH")) if p),
            "SGLANG_STAND_IN_TIMEOUT_S": "30",
        },
    )
    jobs = {
        "job-ok": _job_config(folder, bucket_mb=1, stand_in_record=str(record)),
        "job-fail": _job_config(folder, stand_in_fail_load="CUDA out of memory (stand-in)"),
        "job-secret": _job_config(folder),
    }

    async def scenario() -> None:
        async with (
            connect(trainer.address, default_timeout=120) as trainer_channel,
            connect(rollout.address, default_timeout=120) as rollout_channel,
        ):
            train = trainer_pb2_grpc.TrainerServiceStub(trainer_channel)
            roll = rollout_pb2_grpc.RolloutServiceStub(rollout_channel)
            for job, config in jobs.items():
                await train.LoadPolicy(trainer_pb2.LoadPolicyRequest(job_id=job, config_yaml=config))
                assert (await roll.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=job, config_yaml=config))).engine

            def sync(job: str):
                return (
                    train.PushWeights(trainer_pb2.PushWeightsRequest(job_id=job)),
                    roll.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(job_id=job, weight_version=0)),
                )

            # Twice over the same group: the second sync reuses it (no new epoch, the same store).
            for _ in range(2):
                pushed, received = await asyncio.gather(*sync("job-ok"))
                assert (pushed.weight_version, received.weight_version) == (0, 0)
                assert pushed.checksum == received.checksum == ""  # SGLang reports no digest of what it got
                assert pushed.num_bytes == received.num_bytes == _expected_bytes(folder)
            assert fake.epochs["job-ok"] == 0

            # A replica whose load fails: the push fails with the replica's own reason.
            push, receive = sync("job-fail")
            await asyncio.gather(
                expect_code(push, grpc.StatusCode.UNAVAILABLE, "rank 1", "CUDA out of memory (stand-in)"),
                expect_code(receive, grpc.StatusCode.UNAVAILABLE, "CUDA out of memory (stand-in)"),
            )
            # A replica holding another secret: nothing moves, both sides say why.
            push, receive = sync("job-secret")
            await asyncio.gather(
                expect_code(push, grpc.StatusCode.UNAVAILABLE, "could not prove", "wrong secret"),
                expect_code(receive, grpc.StatusCode.UNAVAILABLE, "rank 0 rejected"),
            )
            # Both failed syncs told the coordinator, which formed the next epoch.
            assert fake.epochs["job-fail"] == 1 and fake.epochs["job-secret"] == 1

    asyncio.run(scenario())
    _assert_received_exactly_the_model(folder, record)
    assert trainer.stop() == 0, trainer.logs()[-3000:]
    assert rollout.stop() == 0, rollout.logs()[-3000:]


def _parameters(folder: Path) -> dict[str, torch.Tensor]:
    """The trainer's weights at version 0: the model folder's parameters, by Hugging Face name, tied once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {name: p.detach() for name, p in model.named_parameters()}


def _expected_bytes(folder: Path) -> int:
    return sum(t.numel() * t.element_size() for t in _parameters(folder).values())


def _assert_received_exactly_the_model(folder: Path, record: Path) -> None:
    """What the stand-in received (saved per update call) is the model, tensor for tensor, in each of two syncs."""
    expected = _parameters(folder)
    calls = sorted(record.glob("v0-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    syncs: list[list[dict[str, torch.Tensor]]] = []
    current: list[dict[str, torch.Tensor]] = []
    for path in calls:
        current.append(load_file(str(path)))
        if json.loads(path.with_suffix(".json").read_text())["flush"]:  # the last bucket of a sync
            syncs.append(current)
            current = []
    assert len(syncs) == 2 and not current, [p.name for p in calls]
    for buckets in syncs:
        assert len(buckets) > 1  # 1 MiB buckets: one update call each
        received = {name: t for bucket in buckets for name, t in bucket.items()}
        assert sum(len(b) for b in buckets) == len(received) == len(expected)
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
