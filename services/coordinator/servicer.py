"""CoordinatorService over gRPC: protobuf to the coordinator's parts and back, their errors to status codes.

    CreateJob / GetJob / ListJobs / CancelJob ─> job_manager.JobManager (registry, runners, the job store)
    GetWeightSyncGroup / LeaveWeightSyncGroup ─> JobManager.join_sync_group / leave_sync_group
    RegisterMember / Heartbeat / UnregisterMember / ListMembers ─> fleet.Fleet
    GetJob's services ─> peers.Peers.health (trainer, buffer) + the fleet's members

Guarantees: this module holds no rule of its own beyond the shape of a request;
what a job is and how it lives is JobManager's (see its guarantees: the store,
recovery, a graceful stop). A job id outside dockyard.jobs.JOB_ID, an empty
config, a config beyond the config bounds (parsed off the event loop), a
member the weight-sync group refuses, a member address over
MAX_ADDRESS_CHARS and a heartbeat with negative or non-finite numbers are
INVALID_ARGUMENT; registering under a name a live member holds at another
address is FAILED_PRECONDITION until that member expires.

Imports: the generated stubs, dockyard.config (parsing) and dockyard.rpc.errors; the coordinator's
fleet, job_manager, peers, settings, store and weight_sync_groups.
"""

from __future__ import annotations

import grpc
import structlog

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import ConfigError, parse_config_text
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.coordinator.fleet import KINDS, Fleet, FleetError
from services.coordinator.job_manager import JobManager, check_job_id
from services.coordinator.peers import Peers
from services.coordinator.settings import CoordinatorSettings
from services.coordinator.store import JobPersister, open_store
from services.coordinator.weight_sync_groups import MembershipError, WeightSyncGroups

log = structlog.get_logger()
MAX_ADDRESS_CHARS = 256  # a host name is at most 253 characters, then :port


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.weight_sync_groups = WeightSyncGroups(settings.weight_sync_address, settings.weight_sync_port)
        self.fleet = Fleet(settings.member_timeout_seconds, max_message_mb=settings.max_message_mb)
        persister = JobPersister(
            open_store(settings.state_dir, settings.state_redis_url, settings.state_redis_password_value)
        )
        self.peers = Peers(settings)
        self.jobs = JobManager(settings, self.peers.stubs(self.fleet), self.weight_sync_groups, persister)

    async def recover(self) -> None:
        """Load every stored job, continue the unfinished ones; StoreUnreadable (job_manager) if it cannot."""
        await self.jobs.recover()

    async def close(self) -> None:
        await self.jobs.close()
        await self.peers.close()
        await self.fleet.close()

    async def _service_statuses(self) -> list[coordinator_pb2.ServiceStatus]:
        fixed = [coordinator_pb2.ServiceStatus(name=n, address=a, status=s) for n, a, s in await self.peers.health()]
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
            check_job_id(request.job_id)
        try:
            config = await parse_config_text(request.config_yaml, origin="config_yaml")
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        record = await self.jobs.create(config, request.job_id)
        return coordinator_pb2.CreateJobResponse(job=record.to_proto())

    async def GetJob(
        self, request: coordinator_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetJobResponse:
        record = self.jobs.get(request.job_id)
        return coordinator_pb2.GetJobResponse(job=record.to_proto(await self._service_statuses()))

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListJobsResponse:
        return coordinator_pb2.ListJobsResponse(jobs=[r.to_proto() for r in self.jobs.newest_first()])

    async def CancelJob(
        self, request: coordinator_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CancelJobResponse:
        record = await self.jobs.cancel(request.job_id)
        return coordinator_pb2.CancelJobResponse(job=record.to_proto())

    async def GetWeightSyncGroup(
        self, request: coordinator_pb2.GetWeightSyncGroupRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetWeightSyncGroupResponse:
        failed = request.failed_epoch if request.HasField("failed_epoch") else None
        try:
            group, rank = self.jobs.join_sync_group(request.job_id, request.member, failed)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        return coordinator_pb2.GetWeightSyncGroupResponse(group=group, rank=rank)

    async def LeaveWeightSyncGroup(
        self, request: coordinator_pb2.LeaveWeightSyncGroupRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaveWeightSyncGroupResponse:
        try:
            group = self.jobs.leave_sync_group(request.job_id, request.member)
        except MembershipError as exc:
            raise InvalidArgument(str(exc)) from None
        return coordinator_pb2.LeaveWeightSyncGroupResponse(group=group)

    async def RegisterMember(
        self, request: coordinator_pb2.RegisterMemberRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterMemberResponse:
        kind = KINDS.get(request.kind)
        if kind is None:
            raise InvalidArgument("kind must be MEMBER_KIND_ROLLOUT or MEMBER_KIND_SANDBOX")
        if len(request.address) > MAX_ADDRESS_CHARS:
            raise InvalidArgument(f"address is {len(request.address)} characters; at most {MAX_ADDRESS_CHARS}")
        if (held := self.fleet.held_elsewhere(request.name, request.address)) is not None:
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
