"""PrepareSessions in the servicer (services/sandbox/servicer.py): the backend's share of a job's sessions (at
most this worker's max_sessions), and a SWE task set's instance images made ahead through SweScorer.image (a
terminal task set's through TerminalTasks), a failing one logged, not fatal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.rpc.errors import NotFound
from services.sandbox.backend import SandboxBackend
from services.sandbox.servicer import SandboxServicer
from services.sandbox.settings import SandboxSettings
from services.sandbox.swe import SweScorer, TaskSetError
from tests.conftest import REPO_ROOT


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
    prepare_images = SweScorer.prepare_images  # the real loop, over this fake's image()

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def image(self, task_set: str, instance) -> str | None:
        self.asked.append((task_set, instance.instance_id))
        if instance.instance_id == "broken":
            raise RuntimeError("cannot pull")
        return f"img-{instance.instance_id}"


def servicer(backend: Backend, swe: Swe) -> SandboxServicer:
    return SandboxServicer(backend, SandboxSettings(coordinator_address=""), swe=swe)


async def test_a_job_share_reaches_the_backend_and_the_images_of_its_instances_are_made():
    backend, swe = Backend(), Swe()
    request = sandbox_pb2.PrepareSessionsRequest(
        job_id="j",
        size=3,
        limits=sandbox_pb2.Limits(memory_mb=300),
        packages=["x==1"],
        routed=True,
        task_set="bugs",
        instance_ids=["a", "broken", "not-in-the-set", "a"],
    )
    reply = await servicer(backend, swe).PrepareSessions(request, None)
    assert (reply.warm, reply.instance_images) == (3, 1)  # the broken one logged, not counted, not fatal
    assert backend.prepared == [("j", 3, 300, {"packages": ["x==1"], "routed": True, "images": []})]
    assert swe.asked == [("bugs", "a"), ("bugs", "broken")]  # only the job's instances, each once (b is not)


async def test_a_task_set_named_without_instances_makes_no_image():
    backend, swe = Backend(), Swe()
    request = sandbox_pb2.PrepareSessionsRequest(job_id="j", size=0, task_set="bugs")
    assert (await servicer(backend, swe).PrepareSessions(request, None)).instance_images == 0
    assert swe.asked == []


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


class Images:
    """TerminalImages' interface: ensure(task) builds the task's image; one task's build fails."""

    def __init__(self) -> None:
        self.built: list[str] = []

    def ensure(self, task):
        if task.task_id == "fix-mean":
            raise RuntimeError("the build failed")
        self.built.append(task.task_id)
        return f"dockyard/terminal:{task.task_id}", "/seed", "/app"


async def test_a_terminal_task_sets_images_are_built_ahead_only_for_the_tasks_the_job_draws():
    from services.sandbox.terminal import TerminalTasks

    images, backend, swe = Images(), Backend(), Swe()
    settings = SandboxSettings(coordinator_address="", task_root=str(REPO_ROOT / "examples" / "tasks"))
    terminal = TerminalTasks(settings.task_root, images)
    request = sandbox_pb2.PrepareSessionsRequest(
        job_id="j", task_set="terminal", instance_ids=["count-errors", "fix-mean", "no-such-task", "count-errors"]
    )
    reply = await SandboxServicer(backend, settings, swe=swe, terminal=terminal).PrepareSessions(request, None)
    assert reply.instance_images == 1  # the failed build logged, not counted, not fatal; the unknown id skipped
    assert images.built == ["count-errors"] and swe.asked == []  # each once; not a SWE set


async def test_a_terminal_task_set_on_a_backend_without_containers_makes_no_image():
    from services.sandbox.terminal import TerminalTasks

    settings = SandboxSettings(coordinator_address="", task_root=str(REPO_ROOT / "examples" / "tasks"))
    request = sandbox_pb2.PrepareSessionsRequest(job_id="j", task_set="terminal", instance_ids=["count-errors"])
    servicer = SandboxServicer(Backend(), settings, swe=Swe(), terminal=TerminalTasks(settings.task_root, None))
    assert (await servicer.PrepareSessions(request, None)).instance_images == 0
