"""A job's sessions prepared on its sandbox workers (services/coordinator/session_warmer.py): the share of
each, told once per worker, a failing worker logged and left cold, and every worker told released."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import load_config
from services.coordinator.session_warmer import SessionWarmer
from tests.conftest import REPO_ROOT


class Worker:
    def __init__(self, fail: bool = False) -> None:
        self.prepared: list[sandbox_pb2.PrepareSessionsRequest] = []
        self.released: list[str] = []
        self.fail = fail

    async def PrepareSessions(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.prepared.append(request)
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(), "no image"
            )
        return sandbox_pb2.PrepareSessionsResponse(warm=request.size)

    async def ReleaseSessions(self, request, timeout=None):  # noqa: N802
        self.released.append(request.job_id)
        return sandbox_pb2.ReleaseSessionsResponse()


class Fleet:
    def __init__(self, **stubs: Worker) -> None:
        self.stubs = stubs

    def alive(self, kind: str):
        assert kind == "sandbox"
        return [SimpleNamespace(name=name, stub=stub) for name, stub in self.stubs.items()]


async def test_each_worker_gets_its_share_once_and_is_released_at_the_end():
    one, two = Worker(), Worker()
    fleet = Fleet(**{"sandbox-1": one, "sandbox-2": two})
    limits = sandbox_pb2.Limits(memory_mb=512)
    warmer = SessionWarmer("job-1", fleet, 5, limits, packages=("mini-swe-agent",), routed=True)
    await warmer.ensure()
    await warmer.ensure()  # nothing new: no second call
    for worker in (one, two):
        assert len(worker.prepared) == 1
        request = worker.prepared[0]
        assert (request.job_id, request.size, request.limits.memory_mb) == ("job-1", 3, 512)  # ceil(5 / 2)
        assert list(request.packages) == ["mini-swe-agent"] and request.routed
    three = Worker()
    fleet.stubs["sandbox-3"] = three  # a worker that joins later is told too
    await warmer.ensure()
    assert [r.size for r in three.prepared] == [2] and len(one.prepared) == 1
    await warmer.release()
    assert one.released == two.released == three.released == ["job-1"]


async def test_a_worker_that_refuses_is_left_cold_and_the_job_goes_on():
    bad, good = Worker(fail=True), Worker()
    warmer = SessionWarmer("job-2", Fleet(bad=bad, good=good), 2, sandbox_pb2.Limits())
    await warmer.ensure()  # no exception: warming is an optimisation
    await warmer.ensure()
    assert len(bad.prepared) == 1 and len(good.prepared) == 1  # told once, answered or not
    await warmer.release()
    assert bad.released == good.released == ["job-2"]


class HangingWorker(Worker):
    async def PrepareSessions(self, request, timeout=None):  # noqa: N802
        self.prepared.append(request)
        await asyncio.Event().wait()  # never answers


async def test_a_hung_worker_holds_no_trial_up_and_is_still_released(monkeypatch):
    monkeypatch.setattr("services.coordinator.session_warmer.RELEASE_TIMEOUT_SECONDS", 0.2)
    hung, good = HangingWorker(), Worker()
    warmer = SessionWarmer("job-3", Fleet(hung=hung, good=good), 2, sandbox_pb2.Limits())
    warmer.ensure_soon()  # returns at once: the trials go on while the workers prepare
    await asyncio.sleep(0.05)
    assert len(hung.prepared) == 1 and len(good.prepared) == 1
    warmer.ensure_soon()  # one under way: no second call
    await asyncio.sleep(0.05)
    assert len(hung.prepared) == 1
    started = asyncio.get_running_loop().time()
    await warmer.release()  # waits for the preparation at most the bound, then releases both
    assert asyncio.get_running_loop().time() - started < 5
    assert hung.released == good.released == ["job-3"]


async def test_a_swe_job_asks_for_the_images_of_the_instances_it_draws_and_no_warm_container():
    worker = Worker()
    config = load_config(REPO_ROOT / "examples" / "configs" / "grpo_swe.yaml", ["policy.bootstrap=null"])
    task_ids = ["bugs/a", "bugs/b", "other/c", "bugs/a"]
    warmer = SessionWarmer.for_job("job-4", Fleet(sandbox=worker), config, sandbox_pb2.Limits(), task_ids)
    warmer.on_group("bugs/b")
    warmer.on_group("other/c")  # the first group's task set counts
    await asyncio.sleep(0.05)
    [request] = worker.prepared
    assert (request.size, request.task_set) == (0, "bugs")
    assert list(request.instance_ids) == ["a", "b"]  # the job's instances of that set, once each
    await warmer.release()


async def test_a_single_turn_swe_job_and_a_terminal_job_ask_for_their_tasks_images():
    for name, overrides, task_ids in (
        ("grpo_swe.yaml", ["env.tools=[]"], ["bugs/a", "bugs/b"]),  # ScorePatch per completion, no session
        ("grpo_terminal_bench.yaml", [], ["tb/hello-world", "tb/fix-git"]),
    ):
        worker = Worker()
        config = load_config(REPO_ROOT / "examples" / "configs" / name, ["policy.bootstrap=null", *overrides])
        warmer = SessionWarmer.for_job("job-5", Fleet(sandbox=worker), config, sandbox_pb2.Limits(), task_ids)
        warmer.on_group(task_ids[1])
        await asyncio.sleep(0.05)
        [request] = worker.prepared
        assert (request.size, request.task_set, list(request.instance_ids)) == (0, task_ids[0].split("/")[0], [
            task_id.split("/")[1] for task_id in task_ids
        ]), (name, request)  # fmt: skip
        await warmer.release()
        assert worker.released == ["job-5"]


async def test_a_single_turn_job_without_a_task_set_tells_no_worker_anything():
    worker = Worker()
    config = load_config(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml", [])
    warmer = SessionWarmer.for_job("job-6", Fleet(sandbox=worker), config, sandbox_pb2.Limits(), ["expr/1"])
    warmer.on_group("expr/1")
    await asyncio.sleep(0.05)
    await warmer.release()
    assert worker.prepared == [] and worker.released == []
