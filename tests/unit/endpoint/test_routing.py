"""Routing of sessions to replicas: stickiness, spreading, failover, admission (services/endpoint/routing.py).

The Router is driven directly; the failover of a call in flight goes through Backend.complete with its two
fleet-facing calls (the member list, one Generate) replaced, so the retry logic is the real one.
"""

from __future__ import annotations

import asyncio

import pytest

from dockyard.api.rollout.v1 import rollout_pb2
from services.endpoint.backend import Backend, Generated, ReplicaLost
from services.endpoint.routing import AdmissionRefused, Replica, Router

A, B = Replica("rollout-a", "a:1"), Replica("rollout-b", "b:1")


def kv(capacity: int) -> rollout_pb2.KvCacheStats:
    return rollout_pb2.KvCacheStats(capacity_tokens=capacity)


def test_sessions_stick_and_new_ones_spread() -> None:
    router = Router()
    first = {s: router.route(s, [A, B], 10).name for s in ("s1", "s2", "s3", "s4")}
    assert sorted(first.values()) == ["rollout-a", "rollout-a", "rollout-b", "rollout-b"]
    for _ in range(3):
        assert {s: router.route(s, [A, B], 10).name for s in first} == first
    # Calls in flight count too: a new session avoids the busy replica when sessions are even.
    router.replicas["rollout-a"].in_flight = 3
    assert router.route("s5", [A, B], 10).name == "rollout-b"
    snap = router.snapshot()
    assert snap["sessions"] == 5 and snap["replicas"]["rollout-b"]["sessions"] == 3


def test_a_session_whose_replica_left_moves_and_stays() -> None:
    router = Router()
    assert router.route("s", [A, B], 10).name == "rollout-a"
    assert router.route("s", [B], 10).name == "rollout-b"  # a left the member list
    assert router.route("s", [A, B], 10).name == "rollout-b"  # and the session stays where it went
    router.failed("rollout-b")  # b failed a call: left out although still listed
    assert router.route("s", [A, B], 10).name == "rollout-a"
    assert router.stats.moved_sessions == 2


def test_admission_queues_new_sessions_fifo_and_serves_running_ones() -> None:
    router = Router(pressure_threshold=0.5, queue_size=2, session_tokens=20)
    router.served("rollout-a", kv(100))
    assert router.route("run", [A], 40).name == "rollout-a"
    router.note_size("run", 60)  # the running session grew past the threshold
    assert router.route("new1", [A], 10) is None and router.route("new2", [A], 10) is None
    with pytest.raises(AdmissionRefused, match="queue full"):
        router.route("new3", [A], 10)
    assert router.route("run", [A], 10).name == "rollout-a"  # running sessions are always served
    assert router.snapshot()["admission"]["queue_depth"] == 2
    router.release("run")
    assert router.route("new2", [A], 10) is None  # not its turn: new1 is first in line
    assert router.route("new1", [A], 10).name == "rollout-a"
    assert router.route("new2", [A], 10).name == "rollout-a"
    assert router.stats.refused_sessions == 1 and router.stats.queued_sessions == 2
    assert router.route("new4", [A], 10) is None  # 20 + 20 + 20 tokens would pass half of 100


def test_without_a_set_reserve_a_session_counts_as_the_mean_ended_one() -> None:
    router = Router(pressure_threshold=0.5)
    router.served("rollout-a", kv(100))
    for name, size in (("x", 30), ("y", 50)):
        router.route(name, [A], 5)
        router.note_size(name, size)
        router.release(name)
    assert router.reserve() == 40
    assert router.route("one", [A], 5).name == "rollout-a" and router.route("two", [A], 5) is None


def test_admission_off_admits_everything() -> None:
    router = Router()
    router.served("rollout-a", kv(10))
    for i in range(20):
        assert router.route(f"s{i}", [A], 100).name == "rollout-a"
    assert router.snapshot()["replicas"]["rollout-a"]["admission_pressure"] == 200.0


class FakeFleet(Backend):
    """Backend with the member list and Generate replaced: `dead` replicas fail their calls, `dies_streaming`
    ones fail a streamed call after its first token."""

    def __init__(self, router: Router, replicas: list[Replica]) -> None:
        super().__init__("127.0.0.1:1", generate_timeout=60, router=router)  # no coordinator is ever asked
        self.listed, self.dead, self.calls = replicas, set(), []
        self.dies_streaming: set[str] = set()

    async def _replicas(self, job_id):
        return list(self.listed)

    async def generate(
        self, job_id, replica, prompt_ids, n, sampling, images=None, on_tokens=None, *, top_logprobs=0, routing=False
    ):
        self.calls.append(replica.name)
        if on_tokens is not None and replica.name in self.dies_streaming:  # a token out, then the replica dies
            on_tokens(0, [1], [-0.5])
            raise ReplicaLost(f"replica {replica.name} failed mid-session: UNAVAILABLE")
        if replica.name in self.dead:
            raise ReplicaLost(f"replica {replica.name} failed mid-session: UNAVAILABLE")
        self.router.served(replica.name, kv(100))
        return Generated(list(prompt_ids), [], 0, [0], replica.name)


async def test_a_stream_goes_elsewhere_only_before_its_first_token() -> None:
    fleet = FakeFleet(Router(), [A, B])
    heard: list[int] = []
    fleet.dead.add("rollout-a")  # dies before any token: the stream starts on the other replica
    reply = await fleet.complete("job", "s", [1], 1, None, on_tokens=lambda i, ids, lps: heard.extend(ids))
    assert reply.replica == "rollout-b" and fleet.calls == ["rollout-a", "rollout-b"] and heard == []
    fleet.dies_streaming.add("rollout-b")  # dies once its client saw a token: no other replica answers instead
    with pytest.raises(ReplicaLost, match="rollout-b"):
        await fleet.complete("job", "s", [1], 1, None, on_tokens=lambda i, ids, lps: heard.extend(ids))
    assert heard == [1] and fleet.calls[2:] == ["rollout-b"]


async def test_a_call_in_flight_on_a_dying_replica_goes_on_elsewhere() -> None:
    fleet = FakeFleet(Router(), [A, B])
    assert (await fleet.complete("job", "s", [1, 2], 1, None)).replica == "rollout-a"
    fleet.dead.add("rollout-a")
    again = await fleet.complete("job", "s", [1, 2, 3], 1, None)
    assert again.replica == "rollout-b" and fleet.calls == ["rollout-a", "rollout-a", "rollout-b"]
    assert fleet.router.stats.retried_calls == 1 and fleet.router.stats.moved_sessions == 1
    fleet.dead.add("rollout-b")  # no replica left: the call is lost
    with pytest.raises(ReplicaLost):
        await fleet.complete("job", "s", [1], 1, None)


async def test_a_queued_session_is_admitted_when_a_running_one_ends_or_refused_after_waiting() -> None:
    router = Router(pressure_threshold=0.5, queue_size=4, wait_seconds=30.0, session_tokens=10)
    fleet = FakeFleet(router, [A])
    await fleet.complete("job", "run", [0] * 60, 1, None)
    router.note_size("run", 60)
    waiting = asyncio.create_task(fleet.complete("job", "new", [0] * 10, 1, None))
    await asyncio.sleep(0.05)
    assert not waiting.done() and router.snapshot()["admission"]["queue_depth"] == 1
    router.release("run")
    assert (await asyncio.wait_for(waiting, 5)).replica == "rollout-a"
    router.note_size("new", 600)
    router.wait_seconds = 0.2
    with pytest.raises(AdmissionRefused, match="within"):
        await fleet.complete("job", "late", [0] * 10, 1, None)
    assert router.snapshot()["admission"]["queue_depth"] == 0


def test_queue_sessions_and_pressure_reach_the_step_metrics_and_dockyard_status() -> None:
    from dockyard.cli.views import fleet_summary
    from services.coordinator.step_metrics import routing_metrics

    router = Router(pressure_threshold=0.5, session_tokens=40)
    router.served("rollout-a", rollout_pb2.KvCacheStats(capacity_tokens=100, prefill_tokens_saved=30, pressure=0.25))
    router.route("run", [A], 40)
    first = routing_metrics(router.snapshot(), {})
    assert router.route("waits", [A], 40) is None
    router.served("rollout-a", rollout_pb2.KvCacheStats(capacity_tokens=100, prefill_tokens_saved=70, pressure=0.5))
    snapshot = router.snapshot()
    metrics = routing_metrics(snapshot, {"replicas": {"rollout-a": {"prefill_tokens_saved": 30}}, **vars(router.stats)})
    assert first["endpoint_queue_depth"] == 0 and metrics["endpoint_queue_depth"] == 1
    assert metrics["replica_rollout-a_sessions"] == 1 and metrics["replica_rollout-a_admission_pressure"] == 0.4
    assert metrics["replica_rollout-a_kv_pressure"] == 0.5 and metrics["replica_rollout-a_prefill_tokens_saved"] == 40
    lines = "\n".join(fleet_summary(metrics))
    assert "admission queue 1" in lines and "rollout-a:" in lines and "kv pressure 0.50" in lines


def test_a_replica_reports_its_kv_pressure_in_heartbeats_and_dockyard_status_lists_it() -> None:
    from types import SimpleNamespace

    from dockyard.cli.views import member_line
    from services.coordinator.fleet import ROLLOUT, Fleet

    fleet = Fleet(6.0, channel_factory=lambda kind, address, mb: (None, SimpleNamespace()))
    fleet.register(ROLLOUT, "rollout-1", "h:1")
    fleet.heartbeat("rollout-1", load=2, running=2, kv_pressure=0.625)
    member = fleet.to_proto()[0]
    assert member.kv_pressure == 0.625 and "kv pressure 0.62" in member_line(member)
