"""PrepareSessions in the servicer (services/sandbox/servicer.py): the backend's share of a job's sessions (at
most this worker's max_sessions), and a SWE task set's instance images made ahead through SweScorer.image, a
failing one logged, not fatal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.rpc.errors import NotFound
from services.sandbox.backend import SandboxBackend
from services.sandbox.servicer import SandboxServicer
from services.sandbox.settings import SandboxSettings
from services.sandbox.swe import TaskSetError


class Backend(SandboxBackend):
    def __init__(self) -> None:
        self.prepared: list[tuple] = []

    async def execute(self, *args, **kwargs):
        raise AssertionError("not called")

    async def run_tests(self, *args, **kwargs):
        raise AssertionError("not called")

    async def prepare_sessions(self, job_id, size, limits, **job):
        self.prepared.append((job_id, size, limits.memory_mb, job))
        return size


class TaskSets:
    def instances(self, task_set: str):
        if task_set != "bugs":
            raise TaskSetError(f"task set {task_set!r} not found", kind="not_found")
        return {i: SimpleNamespace(instance_id=i) for i in ("a", "b", "broken")}


class Swe:
    task_sets = TaskSets()

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def image(self, task_set: str, instance) -> str | None:
        self.asked.append((task_set, instance.instance_id))
        if instance.instance_id == "broken":
            raise RuntimeError("cannot pull")
        return f"img-{instance.instance_id}"


def servicer(backend: Backend, swe: Swe) -> SandboxServicer:
    return SandboxServicer(backend, SandboxSettings(coordinator_address=""), swe=swe)


async def test_a_job_share_reaches_the_backend_and_a_task_sets_images_are_made():
    backend, swe = Backend(), Swe()
    request = sandbox_pb2.PrepareSessionsRequest(
        job_id="j", size=3, limits=sandbox_pb2.Limits(memory_mb=300), packages=["x==1"], routed=True, task_set="bugs"
    )
    reply = await servicer(backend, swe).PrepareSessions(request, None)
    assert (reply.warm, reply.instance_images) == (3, 2)  # the broken one logged, not counted, not fatal
    assert backend.prepared == [("j", 3, 300, {"packages": ["x==1"], "routed": True, "images": []})]
    assert sorted(swe.asked) == [("bugs", "a"), ("bugs", "b"), ("bugs", "broken")]


async def test_an_unknown_task_set_is_not_found_before_anything_is_prepared():
    backend, swe = Backend(), Swe()
    request = sandbox_pb2.PrepareSessionsRequest(job_id="j", size=1, task_set="nope")
    with pytest.raises(NotFound, match="nope"):
        await servicer(backend, swe).PrepareSessions(request, None)
    assert backend.prepared == [] and swe.asked == []


async def test_a_share_above_max_sessions_warms_up_to_it_instead_of_nothing():
    backend = Backend()
    settings = SandboxSettings(coordinator_address="", max_sessions=4)
    reply = await SandboxServicer(backend, settings, swe=Swe()).PrepareSessions(
        sandbox_pb2.PrepareSessionsRequest(job_id="j", size=64), None
    )
    assert reply.warm == 4 and [size for _, size, _, _ in backend.prepared] == [4]
