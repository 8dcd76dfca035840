"""The fleet's membership and routing: expiry, re-registration, failure until the next heartbeat,
least-loaded sticky routing of groups and least-loaded scoring; and the collector's retries over it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.config import load_config
from services.coordinator.collector import Collector
from services.coordinator.fleet import ROLLOUT, SANDBOX, Fleet, FleetError
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.rewards import reward_of
from services.coordinator.task_stream import load_tasks
from tests.conftest import REPO_ROOT


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fleet_with(clock: Clock, timeout: float = 6.0) -> Fleet:
    return Fleet(timeout, clock=clock, channel_factory=lambda kind, address, mb: (None, SimpleNamespace()))


def test_registration_is_checked():
    fleet = fleet_with(Clock())
    for kind, name, address, word in (
        ("trainer", "rollout", "h:1", "kind"),
        (ROLLOUT, "sandbox-1", "h:1", "name"),
        (SANDBOX, "sandbox-1", "h", "address"),
    ):
        with pytest.raises(FleetError, match=word):
            fleet.register(kind, name, address)


def test_a_member_without_heartbeats_expires_and_must_register_again():
    clock = Clock()
    fleet = fleet_with(clock)
    first = fleet.register(ROLLOUT, "rollout-1", "h:1")
    fleet.set_version(first, "job", 3)
    clock.now += 5
    assert fleet.heartbeat("rollout-1", load=0) is first
    clock.now += 5  # 5 s since the last heartbeat: still alive
    assert fleet.alive(ROLLOUT) == [first]
    clock.now += 2
    assert fleet.alive(ROLLOUT) == [] and fleet.to_proto()[0].status == "EXPIRED"
    assert fleet.heartbeat("rollout-1", load=0) is None  # NOT_FOUND: register again
    second = fleet.register(ROLLOUT, "rollout-1", "h:1")
    # A new incarnation holds no job until it is loaded and synced again.
    assert second.incarnation > first.incarnation and second.versions == {}
    assert fleet.alive(ROLLOUT) == [second] and fleet.replicas("job") == []
    assert not fleet.usable(first)


def test_a_failed_member_is_not_routed_to_until_its_next_heartbeat():
    clock = Clock()
    fleet = fleet_with(clock)
    worker = fleet.register(SANDBOX, "sandbox-1", "h:1")
    fleet.mark_failed(worker)
    assert fleet.pick_sandbox() is None and fleet.to_proto()[0].status == "FAILED"
    fleet.heartbeat("sandbox-1", load=0)
    assert fleet.pick_sandbox() is worker


def test_groups_stick_to_their_replica_and_new_groups_go_to_the_least_loaded():
    fleet = fleet_with(Clock())
    a, b = (fleet.register(ROLLOUT, f"rollout-{n}", f"h:{n}") for n in (1, 2))
    for replica in (a, b):
        fleet.set_version(replica, "job", 1)
    fleet.heartbeat("rollout-1", load=3)
    assert fleet.pick_replica("job", "g0", 1) is b
    with fleet.calling(b):
        fleet.heartbeat("rollout-1", load=0)
        # b now has a call in flight: a new group goes to a; the sticky one stays with b.
        assert fleet.pick_replica("job", "g1", 1) is a
        assert fleet.pick_replica("job", "g0", 1) is b
    # Only replicas at the version asked for; None takes any synced replica.
    fleet.set_version(b, "job", 2)
    assert fleet.pick_replica("job", "g0", 1) is a
    assert fleet.pick_replica("job", "g2", 2) is b
    assert {fleet.pick_replica("job", f"h{i}", None).name for i in range(2)} <= {"rollout-1", "rollout-2"}
    fleet.mark_failed(b)
    assert fleet.pick_replica("job", "g2", 2) is None


def test_idle_sandbox_workers_are_used_in_turn():
    fleet = fleet_with(Clock())
    workers = [fleet.register(SANDBOX, f"sandbox-{n}", f"h:{n}") for n in (1, 2, 3)]
    picked = []
    for _ in range(6):
        worker = fleet.pick_sandbox()
        with fleet.calling(worker):
            picked.append(worker.name)
    assert sorted(picked) == sorted([w.name for w in workers] * 2)
    fleet.heartbeat("sandbox-1", load=0, running=4, queued=9)
    assert fleet.to_proto()[0].load == 0


# The collector over a fleet of stand-in members.


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} on purpose")


class Worker:
    """A sandbox stand-in: fails with `code`, or passes every test."""

    def __init__(self, code: grpc.StatusCode | None = None) -> None:
        self.code, self.calls = code, 0

    async def RunTests(self, request, timeout=None):
        self.calls += 1
        if self.code is not None:
            raise rpc_error(self.code)
        verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=1, tests_total=1)
        return SimpleNamespace(verdict=verdict)


class Routing:
    """The version generation must use, and a record of every call to admit replicas that joined."""

    def __init__(self, required_version: int | None = None) -> None:
        self.required_version, self.admitted = required_version, 0

    async def admit(self) -> None:
        self.admitted += 1


def collector_over(fleet: Fleet, routing: Routing | None = None, wait_timeout: float = 120.0) -> Collector:
    config = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", ["policy.bootstrap=null"])
    return Collector(
        "job",
        config,
        fleet,
        SimpleNamespace(data_plane=None),  # a buffer without a data plane: the arrays come back in each reply
        routing or Routing(),
        max_generations=2,
        max_scoring=4,
        generate_timeout=5,
        wait_timeout=wait_timeout,
    )


def a_task(collector: Collector):
    return load_tasks(collector.config, "train")[0]


async def test_scoring_moves_to_another_worker_when_one_is_down():
    fleet = fleet_with(Clock())
    down, up = Worker(grpc.StatusCode.UNAVAILABLE), Worker()
    fleet.register(SANDBOX, "sandbox-1", "h:1").stub = down
    fleet.register(SANDBOX, "sandbox-2", "h:2").stub = up
    collector = collector_over(fleet)
    task = a_task(collector)
    verdict = await collector.score(task, "x", "job/s1/g0/0")
    assert verdict.status == common_pb2.VERDICT_STATUS_PASSED
    assert (down.calls, up.calls, collector.sandbox_retries) == (1, 1, 1)
    assert [w.name for w in fleet.alive(SANDBOX)] == ["sandbox-2"]


async def test_with_every_worker_down_the_verdict_is_an_error_never_a_zero():
    fleet = fleet_with(Clock())
    fleet.register(SANDBOX, "sandbox-1", "h:1").stub = Worker(grpc.StatusCode.UNAVAILABLE)
    fleet.register(SANDBOX, "sandbox-2", "h:2").stub = Worker(grpc.StatusCode.DEADLINE_EXCEEDED)
    fleet.register(SANDBOX, "sandbox-3", "h:3").stub = full = Worker(grpc.StatusCode.RESOURCE_EXHAUSTED)
    collector = collector_over(fleet, wait_timeout=0.1)
    verdict = await collector.score(a_task(collector), "x", "job/s1/g0/0")
    assert verdict.status == common_pb2.VERDICT_STATUS_ERROR and "sandbox" in verdict.error_message
    assert reward_of(verdict, "pass_fraction") == (0.0, False) and collector.sandbox_retries == 2
    # A full worker stays alive (it is only busy); the two that are down leave routing.
    assert fleet.alive(SANDBOX) == [fleet.get("sandbox-3")]
    fleet.mark_failed(fleet.get("sandbox-3"))
    assert full.calls == 1
    # No worker left at all: still an ERROR verdict, which reward_of masks out.
    verdict = await collector.score(a_task(collector), "x", "job/s1/g0/1")
    assert verdict.status == common_pb2.VERDICT_STATUS_ERROR and "no sandbox worker" in verdict.error_message


async def test_a_refused_request_fails_the_job_instead():
    fleet = fleet_with(Clock())
    fleet.register(SANDBOX, "sandbox-1", "h:1").stub = Worker(grpc.StatusCode.INVALID_ARGUMENT)
    collector = collector_over(fleet)
    with pytest.raises(RuntimeError, match="refused"):
        await collector.score(a_task(collector), "x", "job/s1/g0/0")


class Replica:
    def __init__(self, code: grpc.StatusCode | None = None, version: int = 1) -> None:
        self.code, self.version, self.calls = code, version, 0

    async def Generate(self, request, timeout=None):
        self.calls += 1
        if self.code is not None:
            raise rpc_error(self.code)
        return rollout_pb2.GenerateResponse(
            weight_version=self.version, completions=[rollout_pb2.Completion(token_ids=[1, 2], num_tokens=2)]
        )


async def test_a_group_whose_replica_is_lost_is_generated_again_on_another():
    fleet = fleet_with(Clock())
    lost, fine = Replica(grpc.StatusCode.UNAVAILABLE), Replica()
    for name, stub in (("rollout-1", lost), ("rollout-2", fine)):
        member = fleet.register(ROLLOUT, name, "h:1")
        member.stub = stub
        fleet.set_version(member, "job", 1)
    fleet.heartbeat("rollout-2", load=1)  # the lost replica looks idler: it is picked first
    collector = collector_over(fleet, Routing(required_version=1))
    task = a_task(collector)
    reply = await collector.generate(task, 2, collector.config.policy.generation, "job/s2/g0")
    assert reply.weight_version == 1 and (lost.calls, fine.calls) == (1, 1)
    assert collector.regenerated_groups == 1
    assert [(e["replica"], e["group_id"], e["attempt"]) for e in collector.timeline] == [("rollout-2", "job/s2/g0", 1)]


async def test_generation_waits_for_a_replica_at_the_required_version_then_gives_up():
    fleet = fleet_with(Clock())
    member = fleet.register(ROLLOUT, "rollout-1", "h:1")
    member.stub = Replica(version=1)
    fleet.set_version(member, "job", 1)
    routing = Routing(required_version=2)
    collector = collector_over(fleet, routing, wait_timeout=0.1)
    with pytest.raises(RuntimeError, match="no rollout replica ready at weight version 2"):
        await collector.generate(a_task(collector), 1, collector.config.policy.generation, "job/s3/g0")
    assert routing.admitted and member.stub.calls == 0


async def test_scoring_waits_for_the_only_worker_to_come_back():
    clock = Clock()
    fleet = fleet_with(clock)
    worker = fleet.register(SANDBOX, "sandbox-1", "h:1")
    worker.stub = Worker()
    fleet.mark_failed(worker)  # it died: out of routing until it heartbeats again
    collector = collector_over(fleet, wait_timeout=30)
    scoring = asyncio.create_task(collector.score(a_task(collector), "x", "job/s1/g0/0"))
    await asyncio.sleep(0.05)
    assert not scoring.done(), "no worker is alive: the verdict must wait for one, not be an ERROR"
    fleet.heartbeat("sandbox-1", load=0)  # back
    verdict = await asyncio.wait_for(scoring, 5)
    assert verdict.status == common_pb2.VERDICT_STATUS_PASSED and worker.stub.calls == 1


class FlakySandbox:
    """Answers ERROR verdicts (an infrastructure failure) for its first `bad` calls, then passes."""

    def __init__(self, bad: int) -> None:
        self.bad, self.calls = bad, 0

    async def RunTests(self, request, timeout=None):
        self.calls += 1
        status = common_pb2.VERDICT_STATUS_ERROR if self.calls <= self.bad else common_pb2.VERDICT_STATUS_PASSED
        return SimpleNamespace(verdict=common_pb2.Verdict(status=status, tests_passed=1, tests_total=1))


class GroupReplica:
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, timeout=None):
        self.calls += 1
        completion = rollout_pb2.Completion(
            token_ids=[1, 2], logprobs=[-0.1, -0.2], num_tokens=2, text="x", finish_reason="eos"
        )
        return rollout_pb2.GenerateResponse(
            weight_version=1, prompt_token_ids=[3], completions=[completion] * request.num_samples
        )


def fleet_for_groups(bad_verdicts: int) -> tuple[Fleet, GroupReplica, FlakySandbox]:
    fleet = fleet_with(Clock())
    replica = fleet.register(ROLLOUT, "rollout-1", "h:1")
    replica.stub = GroupReplica()
    fleet.set_version(replica, "job", 1)
    sandbox = FlakySandbox(bad_verdicts)
    fleet.register(SANDBOX, "sandbox-1", "h:2").stub = sandbox
    return fleet, replica.stub, sandbox


async def test_a_group_mostly_lost_in_the_sandbox_is_generated_again_not_trained_on():
    n = 8  # the tiny recipe's group size
    fleet, replica, _ = fleet_for_groups(bad_verdicts=n - 1)  # 7 of the first 8 verdicts are ERROR
    collector = collector_over(fleet, Routing(required_version=1))
    group = await collector.make_group(a_task(collector), "job/s2/g0", seed=0)
    assert all(t.valid for t in group.trajectories) and len(group.trajectories) == n
    assert replica.calls == 2 and collector.regenerated_groups == 1


async def test_a_group_that_keeps_failing_in_the_sandbox_is_refused():
    fleet, replica, _ = fleet_for_groups(bad_verdicts=10_000)
    collector = collector_over(fleet, Routing(required_version=1))
    with pytest.raises(GroupUnscorable, match="failed in the sandbox"):
        await collector.make_group(a_task(collector), "job/s2/g0", seed=0)
    assert replica.calls == 4  # the first attempt and max_regenerations (3) more
