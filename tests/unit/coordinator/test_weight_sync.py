"""The weight sync over the fleet: every alive replica at once, one more attempt after a
replica died in it (without it), a suspected trainer restart when the trainer's side failed with
every replica alive, no retry after anything else, checksums on every replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.trainer.v1 import trainer_pb2
from services.coordinator import weight_sync as weight_sync_module
from services.coordinator.fleet import ROLLOUT, Fleet, NoReplica
from services.coordinator.trainer_client import TrainerClient, TrainerRestarted
from services.coordinator.weight_sync import SYNC_ATTEMPTS, WeightSync
from services.coordinator.weight_sync_groups import WeightSyncGroups


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} on purpose")


def answer(results: list, calls: dict, kind: str):
    async def call(request, timeout=None):
        calls[kind] = calls.get(kind, 0) + 1
        result = results.pop(0) if isinstance(results, list) else results
        if isinstance(result, BaseException):
            raise result
        return result

    return call


def replica_stub(receive_results, calls: dict, name: str) -> SimpleNamespace:
    return SimpleNamespace(
        ReceiveWeights=answer(receive_results, calls, f"receive:{name}"),
        LoadPolicy=answer(rollout_pb2.LoadPolicyResponse(), calls, f"load:{name}"),
    )


def make_sync(
    push_results, replicas: dict[str, list], trainer_holds: int = 3, wait_timeout: float = 30.0
) -> tuple[WeightSync, dict]:
    calls: dict = {}
    stubs_by_name = {name: replica_stub(results, calls, name) for name, results in replicas.items()}
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, None))
    for name in replicas:
        member = fleet.register(ROLLOUT, name, "127.0.0.1:1")
        member.stub = stubs_by_name[name]
    groups = WeightSyncGroups("127.0.0.1", port_fn=lambda host: 1234)
    groups.open("job", "gloo")
    stub = SimpleNamespace(
        PushWeights=push_results if callable(push_results) else answer(push_results, calls, "push"),
        # A trainer that is still coming back answers UNAVAILABLE once, then the version it holds.
        LoadPolicy=answer(
            [rpc_error(grpc.StatusCode.UNAVAILABLE), trainer_pb2.LoadPolicyResponse(weight_version=trainer_holds)],
            calls,
            "load:trainer",
        ),
    )
    config = SimpleNamespace(checkpointing=SimpleNamespace(enabled=False))
    trainer = TrainerClient(stub, "job", config, "{}", timeout=5.0, recovery_timeout=5.0)
    sync = WeightSync("job", "{}", fleet, trainer, groups, timeout=5.0, on_policy=True, wait_timeout=wait_timeout)
    return sync, calls


def pushed(seconds: float = 0.5, version: int = 3) -> trainer_pb2.PushWeightsResponse:
    return trainer_pb2.PushWeightsResponse(checksum="abc", seconds=seconds, weight_version=version)


def received(version: int = 3, seconds: float = 0.25) -> rollout_pb2.ReceiveWeightsResponse:
    return rollout_pb2.ReceiveWeightsResponse(checksum="abc", weight_version=version, seconds=seconds)


@pytest.fixture(autouse=True)
def health(monkeypatch):
    """Health answers by replica name: the test sets which are dead."""
    dead: set[str] = set()

    async def channel_health(channel, timeout=2.0):
        return "UNREACHABLE" if channel in dead else "SERVING"

    monkeypatch.setattr(weight_sync_module, "channel_health", channel_health)
    return dead


def dies_in_the_sync(sync: WeightSync, name: str, calls: dict, health: set[str], at_call: int = 1) -> None:
    """`name` receives normally until its `at_call`-th ReceiveWeights, where it dies."""
    member = sync.fleet.get(name)
    member.channel = name

    async def receive(request, timeout=None):
        calls[f"receive:{name}"] = calls.get(f"receive:{name}", 0) + 1
        if calls[f"receive:{name}"] < at_call:
            return received()
        health.add(name)  # from now on it no longer answers health checks
        raise rpc_error(grpc.StatusCode.UNAVAILABLE)

    member.stub.ReceiveWeights = receive


async def test_a_sync_whose_replicas_keep_dying_raises_after_the_last_attempt(health):
    assert SYNC_ATTEMPTS == 2
    lost = rpc_error(grpc.StatusCode.UNAVAILABLE)
    sync, calls = make_sync([lost, lost], {"rollout-a": [received()] * 2, "rollout-b": [], "rollout-c": []})
    dies_in_the_sync(sync, "rollout-b", calls, health)
    dies_in_the_sync(sync, "rollout-c", calls, health, at_call=2)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await sync.sync(3)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert calls["push"] == SYNC_ATTEMPTS
    assert [m.name for m in sync.fleet.alive(ROLLOUT)] == ["rollout-a"]


async def test_other_failures_are_not_retried():
    sync, calls = make_sync([pushed()], {"rollout": [rpc_error(grpc.StatusCode.FAILED_PRECONDITION)]})
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await sync.sync(3)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (calls["push"], calls["receive:rollout"]) == (1, 1)


@pytest.fixture
def trainer_comes_back(monkeypatch) -> list[float]:
    """The waits for a trainer that answers only on the second LoadPolicy (no real sleep)."""
    sleeps: list[float] = []

    async def sleep(seconds):
        sleeps.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return sleeps


async def test_a_push_that_fails_with_every_replica_alive_is_tried_again_if_the_trainer_kept_the_policy(
    trainer_comes_back,
):
    # The trainer's side broke (not UNAVAILABLE on the replica): it is waited for, then asked.
    sync, calls = make_sync(
        [rpc_error(grpc.StatusCode.UNAVAILABLE), pushed()],
        {"rollout": [rpc_error(grpc.StatusCode.INTERNAL), received()]},
    )
    assert await sync.sync(3) == 0.5
    assert (calls["push"], calls["load:trainer"], len(trainer_comes_back)) == (2, 2, 1)


async def test_a_trainer_that_came_back_with_another_version_is_a_restart(trainer_comes_back):
    sync, calls = make_sync(
        [rpc_error(grpc.StatusCode.UNAVAILABLE)], {"rollout": [rpc_error(grpc.StatusCode.INTERNAL)]}, trainer_holds=1
    )
    with pytest.raises(TrainerRestarted, match="holds version 1, not 3"):
        await sync.sync(3)
    assert (calls["push"], calls["load:trainer"]) == (1, 2)


async def test_a_trainer_that_lost_the_policy_is_a_restart_not_a_failed_sync():
    sync, calls = make_sync([rpc_error(grpc.StatusCode.NOT_FOUND)], {"rollout": [received()]})
    with pytest.raises(TrainerRestarted, match="PushWeights"):
        await sync.sync(3)
    assert calls["push"] == 1 and sync.required_version is None


async def test_checksums_that_differ_on_any_replica_fail_the_sync():
    bad = rollout_pb2.ReceiveWeightsResponse(checksum="xyz", weight_version=3)
    sync, _ = make_sync(
        [pushed(version=2), pushed()], {"rollout-a": [received(2), received()], "rollout-b": [received(2), bad]}
    )
    await sync.sync(2)
    with pytest.raises(RuntimeError, match="corrupt.*rollout-b"):
        await sync.sync(3)
    # The replica that holds other bytes than the trainer sent gets no more work, not even at version 2.
    assert [m.name for m in sync.fleet.replicas("job")] == ["rollout-a"]


async def test_replicas_of_a_failed_sync_get_no_work_until_a_sync_succeeds_on_them():
    refused = rpc_error(grpc.StatusCode.FAILED_PRECONDITION)
    sync, _ = make_sync(
        [pushed(version=2), pushed(), pushed(version=4)],
        {"rollout-a": [received(2), received(), received(4)], "rollout-b": [received(2), refused, received(4)]},
    )
    await sync.sync(2)
    with pytest.raises(grpc.aio.AioRpcError):
        await sync.sync(3)
    # Both took part: rollout-a's receive may have ended and rollout-b's stopped part-way; neither is
    # routed to at version 2 (async mode's "any version") with weights that may be part version 3.
    assert sync.fleet.replicas("job") == []
    await sync.sync(4)
    assert [m.name for m in sync.fleet.replicas("job", 4)] == ["rollout-a", "rollout-b"]


async def test_a_replica_whose_receive_failed_gets_no_work_while_the_rest_of_the_sync_runs():
    push_may_end, pushes = asyncio.Event(), []

    async def push(request, timeout=None):  # the second push waits out a dead peer, then fails
        pushes.append(request)
        if len(pushes) == 2:
            await push_may_end.wait()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        return pushed(version=2 if len(pushes) == 1 else 3)

    refused = rpc_error(grpc.StatusCode.UNAVAILABLE)
    sync, _ = make_sync(
        push, {"rollout-a": [received(2), received(3), received(3)], "rollout-b": [received(2), refused, received(3)]}
    )
    await sync.sync(2)
    running = asyncio.ensure_future(sync.sync(3))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if [m.name for m in sync.fleet.replicas("job")] == ["rollout-a"]:
            break
    # rollout-b's weights may be torn: no group goes there, though the sync has not ended.
    assert [m.name for m in sync.fleet.replicas("job")] == ["rollout-a"]
    assert not running.done()
    push_may_end.set()
    await running  # the trainer kept the policy: tried again, and it holds on both
    assert [m.name for m in sync.fleet.replicas("job", 3)] == ["rollout-a", "rollout-b"]


async def test_every_alive_replica_receives_and_the_side_group_has_exactly_them():
    sync, calls = make_sync([pushed()], {"rollout-a": [received()], "rollout-b": [received(seconds=0.75)]})
    assert await sync.sync(3) == 0.75
    group, rank = sync.groups.get("job", "trainer")
    assert (group.world_size, rank) == (3, 0)
    assert [m.name for m in sync.fleet.replicas("job", 3)] == ["rollout-a", "rollout-b"]


async def test_a_replica_that_dies_in_the_sync_is_dropped_and_the_sync_goes_on_without_it(health):
    lost = rpc_error(grpc.StatusCode.UNAVAILABLE)
    sync, calls = make_sync([lost, pushed()], {"rollout-a": [received()] * 2, "rollout-b": []})
    dies_in_the_sync(sync, "rollout-b", calls, health)
    await sync.sync(3)
    assert (calls["push"], calls["receive:rollout-a"], calls["receive:rollout-b"]) == (2, 2, 1)
    group, _ = sync.groups.get("job", "trainer")
    assert group.world_size == 2 and group.epoch >= 2
    assert [m.name for m in sync.fleet.replicas("job", 3)] == ["rollout-a"]


async def test_a_replica_found_dead_before_the_sync_is_left_out_of_the_group(health):
    sync, calls = make_sync([pushed()], {"rollout-a": [received()], "rollout-b": [received()]})
    sync.fleet.get("rollout-b").channel = "b"
    health.add("b")
    await sync.sync(3)
    assert calls["push"] == 1 and "receive:rollout-b" not in calls and "load:rollout-b" not in calls
    group, _ = sync.groups.get("job", "trainer")
    assert group.world_size == 2


async def test_a_replica_that_registers_later_is_loaded_and_joins_the_next_sync():
    sync, calls = make_sync([pushed(version=1), pushed(version=2)], {"rollout-a": [received(1), received(2)]})
    await sync.sync(1)
    late = sync.fleet.register(ROLLOUT, "rollout-b", "127.0.0.1:2")
    late.stub = replica_stub([received(2)], calls, "rollout-b")
    assert sync.fleet.replicas("job", 1) == [sync.fleet.get("rollout-a")]
    await sync.sync(2)
    assert calls["load:rollout-b"] == 1 and calls["load:rollout-a"] == 1
    assert [m.name for m in sync.fleet.replicas("job", 2)] == ["rollout-a", "rollout-b"]


async def test_replicas_synced_to_another_version_than_asked_are_not_routed_to():
    # An asynchronous trainer stepped before the push: the weights are version 4, not 3.
    sync, _ = make_sync([pushed(version=2), pushed(version=4)], {"rollout-a": [received(2), received(3)]})
    await sync.sync(2)
    await sync.sync(3)
    assert sync.fleet.replicas("job") == []  # not at 3, and no longer at 2: it holds version 4's weights


async def test_a_sync_with_no_replica_alive_waits_for_one_to_come_back():
    sync, calls = make_sync([pushed()], {"rollout": [received()]})
    sync.fleet.mark_failed(sync.fleet.get("rollout"))  # the only replica died
    syncing = asyncio.create_task(sync.sync(3))
    await asyncio.sleep(0.05)
    assert not syncing.done() and "push" not in calls, "the sync must wait for a replica, not fail or push"
    sync.fleet.heartbeat("rollout", load=0)  # back
    assert await asyncio.wait_for(syncing, 5) == 0.5
    assert calls["push"] == 1 and [m.name for m in sync.fleet.replicas("job", 3)] == ["rollout"]


async def test_a_sync_gives_up_when_no_replica_comes_back_in_time():
    sync, calls = make_sync([pushed()], {"rollout": [received()]}, wait_timeout=0.1)
    sync.fleet.mark_failed(sync.fleet.get("rollout"))
    with pytest.raises(NoReplica, match="within 0s"):
        await sync.sync(3)
    assert "push" not in calls


async def test_a_replica_that_restarted_under_its_name_gets_a_new_epoch():
    sync, calls = make_sync([pushed(version=1), pushed(version=2)], {"rollout": [received(1)]})
    await sync.sync(1)
    epoch = sync.groups.get("job", "trainer")[0].epoch
    again = sync.fleet.register(ROLLOUT, "rollout", "127.0.0.1:1")  # the same name, a new process
    again.stub = replica_stub([received(2)], calls, "rollout")
    await sync.sync(2)
    assert sync.groups.get("job", "trainer")[0].epoch > epoch, "the old epoch's peer is a dead process"
    assert calls["load:rollout"] == 2  # the new process was loaded before it joined
