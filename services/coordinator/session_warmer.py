"""What a job's sandbox workers need, made ahead: sessions started before its trials open them, its tasks' images.

    Collector, a group's start --> SessionWarmer.ensure_soon(task_set): ensure() in the background, no group waits:
        each alive sandbox worker not yet told (one joining later too):
            PrepareSessions(job, size = ceil(max_concurrent_trials / alive workers), the job's limits,
                            the scaffold's package, routed = an external scaffold;
                            a job on a task set (swe, terminal_bench; agent trials or single-turn
                            ScorePatch): size 0, the task set of its first group and the tasks of it
                            the job draws, whose images the worker makes now)
        a single-turn job on no task set tells no worker anything (it opens no session)
    Collector.close (the job's end) --> release(): a preparation under way awaited (at most
        RELEASE_TIMEOUT_SECONDS, then cancelled), then ReleaseSessions(job) on every worker told

Guarantees: warming is an optimisation, never a job's failure: a worker that refuses or does not
answer is logged and its trials open their sessions cold, as before (a slow one holds no trial up:
the first trials open cold while their worker prepares); each worker is told once per job
(and again after it was lost and came back); release is attempted on every worker told, whatever
happened. Sessions of a task set (SWE, terminal tasks) are not warmed: each instance has its image
and checkout, so no two trials share a key (docker_warm.py); the set's images are made ahead instead,
only those of the tasks the job draws.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import grpc
import structlog

from dockyard.agents.external import session_packages
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import STATE_SCORED_ENVS, MasterConfig
from dockyard.tasks import swe
from services.coordinator.fleet import Fleet

log = structlog.get_logger()

TASK_IMAGE_ENVS = ("swe", "terminal_bench")  # a task set whose tasks each run in an image of their own
PREPARE_TIMEOUT_SECONDS = 900.0  # a scaffold's package image is built the first time
RELEASE_TIMEOUT_SECONDS = 30.0


class SessionWarmer:
    def __init__(
        self,
        job_id: str,
        fleet: Fleet,
        concurrency: int,
        limits: sandbox_pb2.Limits,
        *,
        packages: tuple[str, ...] = (),
        routed: bool = False,
        on_groups: bool = True,
        task_images: bool = False,
        instances: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.job_id, self.fleet, self.concurrency = job_id, fleet, concurrency
        self._limits, self._packages, self._routed = limits, packages, routed
        self._told: dict[str, object] = {}  # worker name -> the stub it was told on
        self._lock = asyncio.Lock()
        self._preparing: asyncio.Task | None = None
        self._task_set = ""
        # on_group warms (a job that warms nothing: False); a swe job's first task set named to the workers.
        self._on_groups, self._task_images = on_groups, task_images
        # A swe job's instances per task set, those it draws: only their images are made ahead.
        self._instances = instances or {}

    @classmethod
    def for_job(
        cls, job_id: str, fleet: Fleet, config: MasterConfig, limits: sandbox_pb2.Limits, task_ids: Sequence[str] = ()
    ) -> SessionWarmer:
        """A job's warmer: an agent job's sessions warmed, unless each task has an image of its own
        (STATE_SCORED_ENVS); a task set's images (swe, terminal_bench) made ahead instead, those of
        `task_ids` (its training tasks), for agent and single-turn jobs alike."""
        scaffold, name = config.env.scaffold, config.env.name
        warm = config.env.agentic and name not in STATE_SCORED_ENVS
        task_images = name in TASK_IMAGE_ENVS
        instances: dict[str, dict[str, None]] = {}  # per task set, its instances once each, in order
        if task_images:
            for task_id in task_ids:
                task_set, instance = swe.split_task_id(task_id)
                instances.setdefault(task_set, {})[instance] = None
        return cls(
            job_id,
            fleet,
            config.grpo.max_concurrent_trials if warm else 0,
            limits,
            packages=session_packages(config.env),
            routed=scaffold is not None,
            on_groups=warm or task_images,
            task_images=task_images,
            instances={task_set: tuple(ids) for task_set, ids in instances.items()},
        )

    def on_group(self, task_id: str) -> None:
        """A group of `task_id` starts: warm ahead (in the background) where this job warms anything."""
        if self._on_groups:
            self.ensure_soon(swe.split_task_id(task_id)[0] if self._task_images else "")

    def size_per_worker(self, workers: int) -> int:
        return math.ceil(self.concurrency / max(workers, 1))

    def ensure_soon(self, task_set: str = "") -> None:
        """ensure() in the background, unless one is under way; `task_set`: the job's (its first one counts)."""
        self._task_set = self._task_set or task_set
        if self._preparing is None or self._preparing.done():
            self._preparing = asyncio.ensure_future(self.ensure())

    async def ensure(self) -> None:
        """PrepareSessions on every alive sandbox worker not yet told (a worker back with a new stub again)."""
        workers = self.fleet.alive("sandbox")
        if all(self._told.get(w.name) is w.stub for w in workers):
            return
        async with self._lock:
            size = self.size_per_worker(len(workers))
            request = sandbox_pb2.PrepareSessionsRequest(
                job_id=self.job_id,
                size=size,
                limits=self._limits,
                packages=self._packages,
                routed=self._routed,
                task_set=self._task_set,
                instance_ids=self._instances.get(self._task_set, ()),
            )
            todo = [w for w in workers if self._told.get(w.name) is not w.stub]
            for worker in todo:  # told before the answer: a release at any point reaches it
                self._told[worker.name] = worker.stub
            results = await asyncio.gather(*(_call(w.stub, "PrepareSessions", request) for w in todo))
            for worker, result in zip(todo, results, strict=True):
                if isinstance(result, grpc.aio.AioRpcError):
                    log.warning(
                        "a sandbox worker keeps no sessions started for the job; its trials open them cold",
                        worker=worker.name,
                        code=result.code().name,
                        details=result.details(),
                    )
                elif isinstance(result, BaseException):
                    log.warning("could not prepare a job's sessions", worker=worker.name, error=repr(result))
                else:
                    images = result.instance_images
                    log.info("sandbox sessions prepared", worker=worker.name, warm=result.warm, instance_images=images)

    async def release(self) -> None:
        """ReleaseSessions(job) on every worker told; one that does not answer keeps the job's containers
        until it stops (its close removes them) or its next start (the reaper)."""
        if self._preparing is not None and not self._preparing.done():
            try:  # its answer first: a release that overtook a PrepareSessions would leave a pool behind
                await asyncio.wait_for(asyncio.shield(self._preparing), RELEASE_TIMEOUT_SECONDS)
            except TimeoutError:
                self._preparing.cancel()
        told, self._told = self._told, {}
        request = sandbox_pb2.ReleaseSessionsRequest(job_id=self.job_id)
        results = await asyncio.gather(*(_call(stub, "ReleaseSessions", request) for stub in told.values()))
        for name, result in zip(told, results, strict=True):
            if isinstance(result, Exception):
                log.warning("could not release a job's warm sessions", worker=name, error=repr(result)[:300])


async def _call(stub, method: str, request):
    """The reply, or the exception the call ended with (a worker's failure is logged, never the job's)."""
    timeout = PREPARE_TIMEOUT_SECONDS if method == "PrepareSessions" else RELEASE_TIMEOUT_SECONDS
    try:
        return await getattr(stub, method)(request, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 -- warming is an optimisation: every failure is logged by the caller
        return exc
