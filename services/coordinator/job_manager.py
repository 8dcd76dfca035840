"""The coordinator's jobs: the registry, their ids, their runners and what a job needs before it starts.

    start ─recover()─> stored jobs: finished ones served as they were; PENDING/RUNNING ones get a
                       runner in recovery mode and a weight-sync group past every epoch they used
    create(config, id) ─> reward preflight, both task splits ─> record (persisted on every change) ─> runner
    cancel(id) ─> CANCELLED, runner stopped          close() ─> unfinished jobs CANCELLED, runners stopped
    join_sync_group / leave_sync_group ─> the job's weight-sync group, its epoch noted on the record

Guarantees: every job is in the job store (folder or Redis) from its creation
on; `recover` serves every stored job and continues the unfinished ones, and
raises StoreUnreadable rather than start without them; `close` (a graceful
stop) persists unfinished jobs as CANCELLED. A job id outside
dockyard.jobs.JOB_ID is InvalidArgument, an unknown one NotFound; a job
created again under its id with the same resolved config is answered with the
job as it is (AlreadyExists with another config); without an id one is minted
(`YYYYmmdd-HHMMSS-<6 hex>`). A missing tracker library or a reward function
that cannot be imported, and a dataset file that is missing, are
FailedPrecondition; a dataset that cannot be read is InvalidArgument. Both
splits are loaded at creation, off the event loop, so a bad dataset is
refused at submit, never minutes into the job. A finished job's weight-sync
group and fleet routing are dropped with its runner.

Imports: the library, and the coordinator's fleet, jobs, run_folder, runner, settings, store,
task_stream and weight_sync_groups; never protobuf services or gRPC status handling.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import structlog

from dockyard.api.common.v1 import common_pb2
from dockyard.config import MasterConfig
from dockyard.jobs import CANCELLED, PENDING, RUNNING, job_id_error
from dockyard.launch_checks import ERROR, check_reward_functions
from dockyard.monitoring.trackers import missing_libraries
from dockyard.rpc.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from dockyard.tasks.task import Task
from services.coordinator.jobs import JobRecord
from services.coordinator.run_folder import RunFolder, confine
from services.coordinator.runner import JobRunner, Stubs
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.store import JobPersister
from services.coordinator.task_stream import load_tasks
from services.coordinator.weight_sync_groups import WeightSyncGroups, check_member

log = structlog.get_logger()


class StoreUnreadable(RuntimeError):
    """The job store cannot be read at startup; the coordinator refuses to start without its jobs."""


def check_job_id(job_id: str) -> None:
    """InvalidArgument unless `job_id` is a job id (dockyard.jobs.JOB_ID)."""
    if error := job_id_error(job_id):
        raise InvalidArgument(error)


class JobManager:
    def __init__(
        self,
        settings: CoordinatorSettings,
        stubs: Stubs,
        weight_sync_groups: WeightSyncGroups,
        persister: JobPersister,
    ) -> None:
        self._settings = settings
        self._stubs = stubs
        self._groups = weight_sync_groups
        self._persister = persister
        self._records: dict[str, JobRecord] = {}
        self._runners: dict[str, asyncio.Task] = {}

    # -- the registry ---------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord:
        """The job's record; InvalidArgument for a malformed id, NotFound for an unknown one."""
        check_job_id(job_id)
        try:
            return self._records[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    def newest_first(self) -> list[JobRecord]:
        return sorted(self._records.values(), key=lambda r: r.created, reverse=True)

    def hold(self, record: JobRecord) -> None:
        """Keep `record` in the registry, persisted on every later change, without starting it."""
        self._records[record.job_id] = record
        self._persister.track(record, write=False)

    # -- lifecycle ------------------------------------------------------------------------------

    async def recover(self) -> None:
        """Load every stored job; continue the unfinished ones."""
        store = self._persister.store
        try:
            documents = await store.load_all()
        except Exception as exc:
            # Starting without the jobs would fork their history: refuse to start instead.
            raise StoreUnreadable(f"cannot read the job store ({store.describe()}): {exc}") from None
        resumed = 0
        for document in documents:
            try:
                record = JobRecord.from_document(document)
            except ValueError as exc:
                log.error("stored job left out", job_id=document.get("job_id"), error=str(exc))
                continue
            self.hold(record)
            if record.state in (PENDING, RUNNING):
                # Past every epoch the job used: no replica mixes an old rendezvous with the new one.
                self._start(record, epoch=record.sync_epoch + 1, recovering=True)
                resumed += 1
        log.info("job store loaded", store=store.describe(), jobs=len(documents), resumed=resumed)

    async def create(self, config: MasterConfig, job_id: str = "") -> JobRecord:
        """Start a job on `config` (already parsed) under `job_id` (checked by the caller), or a new id."""
        config = confine(config, self._settings.run_root)
        if missing := missing_libraries(config.logger):
            raise FailedPrecondition("; ".join(missing))
        if (reward := check_reward_functions(config)).status == ERROR:  # found and defined, never imported
            raise FailedPrecondition(reward.message)
        resolved = config.resolved_yaml()
        if job_id:
            if job_id in self._records:
                existing = self._records[job_id]
                if existing.config_yaml != resolved:
                    raise AlreadyExists(f"job {job_id!r} exists with a different config")
                return existing
        else:
            job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        tasks = await _load_task_splits(config)
        run_dir = Path(config.logger.log_dir) / job_id
        RunFolder(run_dir).write_config(resolved)
        record = JobRecord(job_id=job_id, config=config, config_yaml=resolved, run_dir=str(run_dir))
        self._records[job_id] = record
        self._persister.track(record)
        self._start(record, tasks=tasks)
        log.info("job created", job_id=job_id, run_dir=str(run_dir))
        return record

    async def cancel(self, job_id: str) -> JobRecord:
        """CANCELLED (FailedPrecondition for a finished job), then its runner stopped."""
        record = self.get(job_id)
        record.transition(CANCELLED, "cancelled by request")
        task = self._runners.get(record.job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return record

    async def close(self) -> None:
        """A graceful stop: unfinished jobs CANCELLED, every runner stopped, the store written."""
        for record in self._records.values():
            if not record.finished:
                record.transition(CANCELLED, "the coordinator shut down")
        for task in self._runners.values():
            task.cancel()
        await asyncio.gather(*self._runners.values(), return_exceptions=True)
        await self._persister.close()

    def _start(
        self, record: JobRecord, *, epoch: int = 0, recovering: bool = False, tasks: dict[str, list[Task]] | None = None
    ) -> None:
        job_id = record.job_id
        self._groups.open(job_id, record.config.cluster.weight_sync_backend, epoch)
        record.touch(sync_epoch=epoch)
        runner = JobRunner(
            record,
            self._stubs,
            self._settings,
            self._groups,
            recovering=recovering,
            flush=self._persister.flush,
            tasks=tasks,
        )
        task = self._runners[job_id] = asyncio.create_task(runner.run())
        fleet = self._stubs.fleet
        # A finished job's rendezvous is gone for good; drop it with the runner.
        task.add_done_callback(lambda _: (self._groups.drop(job_id), fleet.forget_job(job_id)))

    # -- weight-sync groups ---------------------------------------------------------------------

    def join_sync_group(
        self, job_id: str, member: str, failed_epoch: int | None
    ) -> tuple[common_pb2.WeightSyncGroup, int]:
        """The job's group and `member`'s rank in it (formed again past `failed_epoch`); MembershipError
        for a member that may not join, FailedPrecondition once the job has finished."""
        record = self.get(job_id)
        check_member(member)
        if record.finished or record.job_id not in self._groups:
            raise FailedPrecondition(f"job {record.job_id} has finished; its weight-sync group is gone")
        group, rank = self._groups.get(record.job_id, member, failed_epoch)
        _note_epoch(record, group)
        if failed_epoch is not None:
            log.warning("weight-sync group formed again after a failed sync", job_id=record.job_id, epoch=group.epoch)
        return group, rank

    def leave_sync_group(self, job_id: str, member: str) -> common_pb2.WeightSyncGroup:
        """The job's group without the replica `member`; MembershipError for a member that is no replica."""
        record = self.get(job_id)
        check_member(member, replica_only=True)
        if record.job_id not in self._groups:
            raise FailedPrecondition(f"job {record.job_id} has finished; its weight-sync group is gone")
        group = self._groups.leave(record.job_id, member)
        _note_epoch(record, group)
        return group


def _note_epoch(record: JobRecord, group: common_pb2.WeightSyncGroup) -> None:
    # Persisted, so a recovered job's group starts past every epoch a replica may still hold.
    if group.epoch != record.sync_epoch:
        record.touch(sync_epoch=group.epoch)


async def _load_task_splits(config: MasterConfig) -> dict[str, list[Task]]:
    """Both splits' tasks, read off the event loop: a bad dataset is refused at submit, naming the file,
    the line and the field, never minutes into the job."""
    try:
        return await asyncio.to_thread(lambda: {split: load_tasks(config, split) for split in ("train", "validation")})
    except FileNotFoundError as exc:
        raise FailedPrecondition(f"data: {exc}") from None
    except ValueError as exc:
        raise InvalidArgument(f"data: {exc}") from None
