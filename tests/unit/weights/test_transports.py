"""The refit plan, the checkpoint-folder transport and the coordinator's weight-sync group epochs, in one process."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import torch

from dockyard.weights.collective import TensorSink, _layout, _pieces
from dockyard.weights.group import SyncFailed
from dockyard.weights.refit import RefitError, TensorSpec, canonical_name, refit_plan
from dockyard.weights.synchronizer import WeightSyncFailed, WeightSynchronizer
from dockyard.weights.transports import CheckpointTransport
from services.coordinator.weight_sync_groups import MembershipError, WeightSyncGroups


def _trainer_weights() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("_orig_mod.model.embed_tokens.weight", torch.randn(11, 4, generator=gen)),
        ("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.weight", torch.randn(4, 4, generator=gen)),
        ("model.norm.weight", torch.randn(4, generator=gen)),
    ]


def _engine_tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.zeros(11, 4, dtype=dtype),
        "model.layers.0.mlp.weight": torch.zeros(4, 4, dtype=dtype),
        "model.norm.weight": torch.zeros(4, dtype=dtype),
    }


def test_canonical_names_drop_wrapper_segments_only() -> None:
    assert canonical_name("_fsdp_wrapped_module.model._orig_mod.layers.0.weight") == "model.layers.0.weight"
    assert canonical_name("module.lm_head.weight") == "lm_head.weight"
    assert canonical_name("model.modules_x.weight") == "model.modules_x.weight"


def test_refit_plan_maps_wrapped_names_and_names_every_mismatch() -> None:
    sent = [TensorSpec.of(n, t) for n, t in _trainer_weights()]
    engine = {n: TensorSpec.of(n, t) for n, t in _engine_tensors(torch.bfloat16).items()}
    assert refit_plan(sent, engine) == list(engine)  # dtype may differ: the receiver casts
    assert refit_plan(sent, None) == list(engine)  # an engine that loads by checkpoint name

    engine["model.norm.weight"] = TensorSpec("model.norm.weight", (5,), "float32")
    engine["lm_head.weight"] = TensorSpec("lm_head.weight", (11, 4), "float32")
    with pytest.raises(RefitError) as err:
        refit_plan(sent + [TensorSpec("model.extra", (1,), "float32")], engine)
    message = str(err.value)
    assert "weight layouts differ" in message
    assert "model.extra" in message and "lm_head.weight" in message and "model.norm.weight: trainer [4]" in message
    with pytest.raises(RefitError, match="more than once"):
        refit_plan([sent[0], TensorSpec("module." + sent[0].name, (11, 4), "float32")], None)


def test_stream_pieces_cover_every_byte_of_tensors_that_span_buckets() -> None:
    specs = [TensorSpec("a", (3,), "bfloat16"), TensorSpec("b", (100,), "float32"), TensorSpec("c", (7,), "float64")]
    offsets, total = _layout(specs)
    assert offsets == [0, 64, 64 + 448] and total == 64 + 448 + 56
    covered = {i: 0 for i in range(3)}
    for lo in range(0, total, 128):  # buckets far smaller than b
        for i, a, b, s, e in _pieces(specs, offsets, lo, min(total, lo + 128)):
            assert (e - s) == (b - a) * specs[i].torch_dtype.itemsize
            covered[i] += b - a
    assert covered == {0: 3, 1: 100, 2: 7}


def test_checkpoint_folder_moves_exact_weights_through_the_refit(tmp_path) -> None:
    transport = CheckpointTransport(tmp_path, timedelta(seconds=5), shard_bytes=200, keep=2)
    weights = _trainer_weights()
    sent = transport.send(weights, version=3)
    engine = _engine_tensors()
    got = transport.receive(TensorSink(targets=engine), version=3)
    assert got.checksum == sent.checksum and len(sent.checksum) == 64 and got.num_bytes == sent.num_bytes
    for (_, source), target in zip(weights, engine.values(), strict=True):
        assert torch.equal(source, target)
    assert len(list((tmp_path / "v00000003").glob("shard-*.safetensors"))) >= 2  # 200-byte shards

    # Older versions are pruned; a loader of whole tensors gets canonical names; bf16 targets are cast.
    transport.send(weights, version=4)
    transport.send(weights, version=5)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v00000004", "v00000005"]
    loaded: dict[str, torch.Tensor] = {}
    transport.receive(TensorSink(load=lambda items: loaded.update(items)), version=5)
    assert list(loaded) == list(engine)
    low = _engine_tensors(torch.bfloat16)
    transport.receive(TensorSink(targets=low), version=5)
    assert torch.equal(low["model.norm.weight"], weights[2][1].to(torch.bfloat16))


def test_checkpoint_folder_refuses_a_wrong_layout_and_a_missing_version_in_time(tmp_path) -> None:
    transport = CheckpointTransport(tmp_path, timedelta(seconds=0.3))
    transport.send(_trainer_weights(), version=1)
    wrong = _engine_tensors()
    wrong["model.norm.weight"] = torch.zeros(5)
    with pytest.raises(RefitError, match="model.norm.weight"):
        transport.receive(TensorSink(targets=wrong), version=1)
    with pytest.raises(SyncFailed, match="no weights of version 2"):
        transport.receive(TensorSink(targets=_engine_tensors()), version=2)

    # Through the synchronizer: a failure keeps it stale and says what happened.
    sync = WeightSynchronizer(transport)
    sync.mark_stale(2)
    with pytest.raises(WeightSyncFailed, match="version 2 failed"):
        asyncio.run(sync.sync_weights(TensorSink(targets=_engine_tensors())))
    assert sync.is_stale
    transport.send(_trainer_weights(), version=2)
    asyncio.run(sync.sync_weights(TensorSink(targets=_engine_tensors())))
    assert not sync.is_stale and sync.version == 2


def test_side_group_epochs_follow_membership_and_failures() -> None:
    ports = iter(range(30000, 30100))
    registry = WeightSyncGroups("10.0.0.1", port_fn=lambda host: next(ports))
    registry.open("job", "nccl")
    group, rank = registry.get("job", "trainer")
    assert (group.epoch, group.world_size, group.master_port, group.backend, rank) == (0, 2, 30000, "nccl", 0)
    assert registry.get("job", "rollout")[1] == 1

    group, rank = registry.get("job", "rollout-b")  # joins: formed again with three members
    assert (group.epoch, group.world_size, group.master_port, rank) == (1, 3, 30001, 2)
    assert registry.get("job", "trainer")[0].epoch == 1

    # Two members report the same failed epoch: the group moves on once.
    assert registry.get("job", "trainer", failed_epoch=1)[0].epoch == 2
    assert registry.get("job", "rollout-b", failed_epoch=1)[0].epoch == 2
    assert registry.get("job", "rollout", failed_epoch=0)[0].epoch == 2  # a stale report changes nothing

    group = registry.leave("job", "rollout")
    assert (group.epoch, group.world_size) == (3, 2)
    assert registry.get("job", "rollout-b")[1] == 1  # ranks close up
    assert registry.leave("job", "rollout").epoch == 3  # leaving twice changes nothing
    with pytest.raises(MembershipError, match="member"):
        registry.get("job", "sandbox")
    with pytest.raises(MembershipError, match="rollout replica"):
        registry.leave("job", "trainer")


def test_coordinator_rpcs_hand_out_epochs_and_refuse_bad_members(tmp_path) -> None:
    from dockyard.api.coordinator.v1 import coordinator_pb2 as pb
    from dockyard.config import load_config_text
    from dockyard.jobs import CANCELLED
    from dockyard.rpc.errors import FailedPrecondition, InvalidArgument
    from services.coordinator.jobs import JobRecord
    from services.coordinator.servicer import CoordinatorServicer
    from services.coordinator.settings import CoordinatorSettings

    async def scenario() -> None:
        servicer = CoordinatorServicer(CoordinatorSettings())
        config = load_config_text("policy: {model: {model_type: qwen2}}")
        record = JobRecord(job_id="j", config=config, config_yaml="", run_dir=str(tmp_path))
        servicer.jobs.hold(record)
        servicer.weight_sync_groups.open("j", "gloo")
        try:
            get = lambda member, **kw: servicer.GetWeightSyncGroup(  # noqa: E731
                pb.GetWeightSyncGroupRequest(job_id="j", member=member, **kw), None
            )
            first = await get("trainer")
            assert (first.group.epoch, first.group.world_size, first.rank) == (0, 2, 0)
            assert (await get("trainer", failed_epoch=0)).group.epoch == 1
            assert (await get("rollout", failed_epoch=0)).group.epoch == 1  # reported late: no new epoch
            joined = await get("rollout-b")
            assert (joined.group.epoch, joined.group.world_size, joined.rank) == (2, 3, 2)
            left = await servicer.LeaveWeightSyncGroup(
                pb.LeaveWeightSyncGroupRequest(job_id="j", member="rollout-b"), None
            )
            assert (left.group.epoch, left.group.world_size) == (3, 2)
            with pytest.raises(InvalidArgument, match="member"):
                await get("sandbox")
            with pytest.raises(InvalidArgument, match="rollout replica"):
                await servicer.LeaveWeightSyncGroup(pb.LeaveWeightSyncGroupRequest(job_id="j", member="trainer"), None)
            record.transition(CANCELLED, "test")
            with pytest.raises(FailedPrecondition, match="finished"):
                await get("trainer")
        finally:
            await servicer.close()

    asyncio.run(scenario())
