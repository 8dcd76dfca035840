"""The coordinator as a WeightSynchronizer's source of weight-sync groups, and the transport a job's config asks for.

Guarantees: a member always forms the weight-sync group the coordinator hands
out now (the transport keeps its member while that group is unchanged and
forms a new one, closing the old, when the epoch moves), with the epoch's
secret from the same answer; reporting a failed epoch makes the coordinator
form the next one.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.config import MasterConfig
from dockyard.weights.colocated import ColocatedTransport
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.synchronizer import GroupSource
from dockyard.weights.transport import Transport
from dockyard.weights.transports import CheckpointTransport, CollectiveTransport
from dockyard.weights.whole_tensor import WholeTensorTransport


def coordinator_group_source(
    coordinator: coordinator_pb2_grpc.CoordinatorServiceStub, job_id: str, member: str, rpc_timeout: float = 30.0
) -> GroupSource:
    async def source(failed_epoch: int | None) -> WeightSyncGroup:
        request = coordinator_pb2.GetWeightSyncGroupRequest(job_id=job_id, member=member)
        if failed_epoch is not None:
            request.failed_epoch = failed_epoch
        reply = await coordinator.GetWeightSyncGroup(request, timeout=rpc_timeout)
        g = reply.group
        return WeightSyncGroup(
            g.master_address, g.master_port, g.world_size, reply.rank, g.epoch, g.backend, secret=g.secret
        )

    return source


def transport_for(config: MasterConfig, job_id: str, timeout: timedelta, device: str | None = None) -> Transport:
    """The transport of `cluster.weight_sync_transport`, with the job's bucket size and folder.

    The one place that picks it, for the trainer and the replicas alike: a collective job whose
    rollout engine is SGLang (policy.generation.backend) speaks the whole-tensor protocol.

    `device` is where this member's weights live (the service's device setting).
    """
    cluster = config.cluster
    bucket = cluster.weight_sync_bucket_mb * 2**20
    if cluster.weight_sync_transport == "checkpoint":
        folder = cluster.weight_sync_folder or str(Path(config.logger.log_dir) / job_id / "weights")
        return CheckpointTransport(folder, timeout, shard_bytes=bucket, checksum=cluster.weight_sync_checksum)
    if cluster.weight_sync_transport == "colocated":  # one device: memory handles, not a collective
        return ColocatedTransport(timeout, bucket, checksum=cluster.weight_sync_checksum, device=device)
    if config.policy.generation.backend == "sglang":  # SGLang receives whole tensors (whole_tensor.py)
        return WholeTensorTransport(timeout, bucket, device=device)
    return CollectiveTransport(timeout, bucket, checksum=cluster.weight_sync_checksum, device=device)
