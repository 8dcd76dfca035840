"""CoordinatorService over gRPC: job CRUD, weight-sync groups, fleet membership, a runner per job.

    start ─recover()─> stored jobs: finished ones served as they were; PENDING/RUNNING ones get a
                       runner in recovery mode and a weight-sync group past every epoch they used
    CreateJob ─> record (persisted on every change) ─> runner

Guarantees: every job is in the job store (folder or Redis) from its creation
on; a coordinator that dies without a graceful stop (SIGKILL, OOM, a lost host)
and starts again on the same store serves every job it had and continues the
unfinished ones; a graceful stop (SIGTERM) cancels unfinished jobs, persisted
as CANCELLED, as before. A job id outside dockyard.jobs.JOB_ID, a config beyond
the config bounds (parsed off the event loop), a dataset that cannot be read
(both splits are loaded at CreateJob, off the event loop; a missing file is
FAILED_PRECONDITION) and a member address over MAX_ADDRESS_CHARS are
INVALID_ARGUMENT; registering under a name a live member holds at another
address is FAILED_PRECONDITION until that member expires.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import grpc
import structlog

from dockyard.api.buffer.v1 import buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2_grpc
from dockyard.config import ConfigError, MasterConfig, parse_config_text
from dockyard.jobs import CANCELLED, PENDING, RUNNING, job_id_error
from dockyard.launch_checks import ERROR, check_reward_functions
from dockyard.monitoring.trackers import missing_libraries
from dockyard.rpc.client import channel_health, connect
from dockyard.rpc.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from dockyard.tasks.task import Task
from services.coordinator.fleet import KINDS, Fleet, FleetError
from services.coordinator.jobs import JobRecord
from services.coordinator.run_folder import RunFolder, confine
from services.coordinator.runner import JobRunner, Stubs
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.store import JobPersister, open_store
from services.coordinator.task_stream import load_tasks
from services.coordinator.weight_sync_groups import MembershipError, WeightSyncGroups, check_member

log = structlog.get_logger()
MAX_ADDRESS_CHARS = 256  # a host name is at most 253 characters, then :port


class StoreUnreadable(RuntimeError):
    """The job store cannot be read at startup; the coordinator refuses to start without its jobs."""


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.jobs: dict[str, JobRecord] = {}
        self.runners: dict[str, asyncio.Task] = {}
        self.weight_sync_groups = WeightSyncGroups(settings.weight_sync_address, settings.weight_sync_port)
        self.fleet = Fleet(settings.member_timeout_seconds, max_message_mb=settings.max_message_mb)
        self.persister = JobPersister(
            open_store(settings.state_dir, settings.state_redis_url, settings.state_redis_password_value)
        )
        self._channels = {
            name: connect(
                getattr(settings, f"{name}_address"),
                service=f"dockyard.{name}.v1.{name.capitalize()}Service",
                max_message_mb=settings.max_message_mb,
            )
            for name in ("trainer", "buffer")
        }
        self.stubs = Stubs(
            trainer=trainer_pb2_grpc.TrainerServiceStub(self._channels["trainer"]),
            buffer=buffer_pb2_grpc.BufferServiceStub(self._channels["buffer"]),
            fleet=self.fleet,
        )

    async def close(self) -> None:
        for record in self.jobs.values():
            if not record.finished:
                record.transition(CANCELLED, "the coordinator shut down")
        for task in self.runners.values():
            task.cancel()
        await asyncio.gather(*self.runners.values(), return_exceptions=True)
        await self.persister.close()
        for channel in self._channels.values():
            await channel.close()
        await self.fleet.close()

    async def recover(self) -> None:
        """Load every stored job; continue the unfinished ones."""
        store = self.persister.store
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
            self.jobs[record.job_id] = record
            self.persister.track(record, write=False)
            if record.state in (PENDING, RUNNING):
                # Past every epoch the job used: no replica mixes an old rendezvous with the new one.
                self._start(record, epoch=record.sync_epoch + 1, recovering=True)
                resumed += 1
        log.info("job store loaded", store=store.describe(), jobs=len(documents), resumed=resumed)

    def _start(
        self, record: JobRecord, *, epoch: int = 0, recovering: bool = False, tasks: dict[str, list[Task]] | None = None
    ) -> None:
        job_id = record.job_id
        self.weight_sync_groups.open(job_id, record.config.cluster.weight_sync_backend, epoch)
        record.touch(sync_epoch=epoch)
        runner = JobRunner(
            record,
            self.stubs,
            self.settings,
            self.weight_sync_groups,
            recovering=recovering,
            flush=self.persister.flush,
            tasks=tasks,
        )
        task = self.runners[job_id] = asyncio.create_task(runner.run())
        # A finished job's rendezvous is gone for good; drop it with the runner.
        task.add_done_callback(lambda _: (self.weight_sync_groups.drop(job_id), self.fleet.forget_job(job_id)))

    def _note_epoch(self, record: JobRecord, group: common_pb2.WeightSyncGroup) -> None:
        if group.epoch != record.sync_epoch:
            record.touch(sync_epoch=group.epoch)

    def _record(self, job_id: str) -> JobRecord:
        _check_job_id(job_id)
        try:
            return self.jobs[job_id]
        except KeyError:
            raise NotFound(f"no job {job_id!r}") from None

    async def _service_statuses(self) -> list[coordinator_pb2.ServiceStatus]:
        names = list(self._channels)
        addresses = [getattr(self.settings, f"{name}_address") for name in names]
        # The coordinator's own channels: no new connection per GetJob, which clients poll.
        statuses = await asyncio.gather(*(channel_health(self._channels[n], timeout=1.0) for n in names))
        fixed = [
            coordinator_pb2.ServiceStatus(name=n, address=a, status=s)
            for n, a, s in zip(names, addresses, statuses, strict=True)
        ]
        # Rollout replicas and sandbox workers as registered: ALIVE, FAILED or EXPIRED.
        members = [
            coordinator_pb2.ServiceStatus(name=m.name, address=m.address, status=m.status)
            for m in self.fleet.to_proto()
        ]
        return fixed + members

    async def CreateJob(
        self, request: coordinator_pb2.CreateJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CreateJobResponse:
        if not request.config_yaml.strip():
            raise InvalidArgument("config_yaml is empty: send the job config as YAML")
        if request.job_id:
            _check_job_id(request.job_id)
        try:
            config = await parse_config_text(request.config_yaml, origin="config_yaml")
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        config = confine(config, self.settings.run_root)
        if missing := missing_libraries(config.logger):
            raise FailedPrecondition("; ".join(missing))
        if (reward := check_reward_functions(config)).status == ERROR:  # found and defined, never imported
            raise FailedPrecondition(reward.message)
        resolved = config.resolved_yaml()
        job_id = request.job_id
        if job_id:
            if job_id in self.jobs:
                existing = self.jobs[job_id]
                if existing.config_yaml != resolved:
                    raise AlreadyExists(f"job {job_id!r} exists with a different config")
                return coordinator_pb2.CreateJobResponse(job=existing.to_proto())
        else:
            job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        tasks = await _load_task_splits(config)
        run_dir = Path(config.logger.log_dir) / job_id
        RunFolder(run_dir).write_config(resolved)
        record = JobRecord(job_id=job_id, config=config, config_yaml=resolved, run_dir=str(run_dir))
        self.jobs[job_id] = record
        self.persister.track(record)
        self._start(record, tasks=tasks)
        log.info("job created", job_id=job_id, run_dir=str(run_dir))
        return coordinator_pb2.CreateJobResponse(job=record.to_proto())

    async def GetJob(
        self, request: coordinator_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetJobResponse:
        record = self._record(request.job_id)
        return coordinator_pb2.GetJobResponse(job=record.to_proto(await self._service_statuses()))

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListJobsResponse:
        records = sorted(self.jobs.values(), key=lambda r: r.created, reverse=True)
        return coordinator_pb2.ListJobsResponse(jobs=[r.to_proto() for r in records])

    async def CancelJob(
        self, request: coordinator_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CancelJobResponse:
        record = self._record(request.job_id)
        record.transition(CANCELLED, "cancelled by request")
        task = self.runners.get(record.job_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return coordinator_pb2.CancelJobResponse(job=record.to_proto())

    async def GetWeightSyncGroup(
        self, request: coordinator_pb2.GetWeightSyncGroupRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetWeightSyncGroupResponse:
        record = self._record(request.job_id)
        try:
            check_member(request.member)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        if record.finished or record.job_id not in self.weight_sync_groups:
            raise FailedPrecondition(f"job {record.job_id} has finished; its weight-sync group is gone")
        failed = request.failed_epoch if request.HasField("failed_epoch") else None
        try:
            group, rank = self.weight_sync_groups.get(record.job_id, request.member, failed)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        self._note_epoch(record, group)
        if failed is not None:
            log.warning("weight-sync group formed again after a failed sync", job_id=record.job_id, epoch=group.epoch)
        return coordinator_pb2.GetWeightSyncGroupResponse(group=group, rank=rank)

    async def LeaveWeightSyncGroup(
        self, request: coordinator_pb2.LeaveWeightSyncGroupRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaveWeightSyncGroupResponse:
        record = self._record(request.job_id)
        try:
            check_member(request.member, replica_only=True)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        if record.job_id not in self.weight_sync_groups:
            raise FailedPrecondition(f"job {record.job_id} has finished; its weight-sync group is gone")
        try:
            group = self.weight_sync_groups.leave(record.job_id, request.member)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        self._note_epoch(record, group)
        return coordinator_pb2.LeaveWeightSyncGroupResponse(group=group)

    async def RegisterMember(
        self, request: coordinator_pb2.RegisterMemberRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterMemberResponse:
        kind = KINDS.get(request.kind)
        if kind is None:
            raise InvalidArgument("kind must be MEMBER_KIND_ROLLOUT or MEMBER_KIND_SANDBOX")
        if len(request.address) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"address is {len(request.address)} characters; at most {MAX_ADDRESS_CHARS}")
        held = self.fleet.get(request.name)
        now = time.monotonic()  # the fleet's clock
        if (
            held is not None
            and held.address != request.address
            and held.status(now, self.fleet.member_timeout) == "ALIVE"
        ):
            raise FailedPrecondition(
                f"name {request.name!r} is held by a live member at {held.address}; "
                "register under another name, or again once it has expired"
            )
        try:
            member = self.fleet.register(kind, request.name, request.address)
        except FleetError as exc:
            raise InvalidArgument(str(exc)) from None
        log.info("member registered", kind=kind, member=member.name, address=member.address)
        return coordinator_pb2.RegisterMemberResponse(heartbeat_seconds=self.fleet.member_timeout / 3)

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        if not request.name:
            raise InvalidArgument("name is required")
        if min(request.load, request.running, request.queued) < 0:
            raise InvalidArgument("load, running and queued must be >= 0")
        if not 0.0 <= request.kv_pressure < float("inf"):
            raise InvalidArgument("kv_pressure must be a finite number >= 0")
        if (
            self.fleet.heartbeat(request.name, request.load, request.running, request.queued, request.kv_pressure)
            is None
        ):
            raise NotFound(f"no live member {request.name!r}: register again")
        return coordinator_pb2.HeartbeatResponse()

    async def UnregisterMember(
        self, request: coordinator_pb2.UnregisterMemberRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.UnregisterMemberResponse:
        if not request.name:
            raise InvalidArgument("name is required")
        if not self.fleet.unregister(request.name):
            raise NotFound(f"no member {request.name!r}")
        log.info("member left", member=request.name)
        return coordinator_pb2.UnregisterMemberResponse()

    async def ListMembers(
        self, request: coordinator_pb2.ListMembersRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListMembersResponse:
        return coordinator_pb2.ListMembersResponse(members=self.fleet.to_proto())


async def _load_task_splits(config: MasterConfig) -> dict[str, list[Task]]:
    """Both splits' tasks, read off the event loop: a bad dataset is refused at submit, naming the file,
    the line and the field, never minutes into the job."""
    try:
        return await asyncio.to_thread(lambda: {split: load_tasks(config, split) for split in ("train", "validation")})
    except FileNotFoundError as exc:
        raise FailedPrecondition(f"data: {exc}") from None
    except ValueError as exc:
        raise InvalidArgument(f"data: {exc}") from None


def _check_job_id(job_id: str) -> None:
    if error := job_id_error(job_id):
        raise InvalidArgument(error)
