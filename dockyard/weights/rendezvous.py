"""Joining a job's side group with the rendezvous the coordinator hands out.

Guarantees: a member keeps its SideGroup while the coordinator's rendezvous
(address, port, world size, rank, epoch, backend) is unchanged, and forms a
new one, closing the old, as soon as it changes (a new epoch).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from dockyard.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.weights.collective import Rendezvous, SideGroup


async def current_side_group(
    coordinator: coordinator_pb2_grpc.CoordinatorServiceStub,
    job_id: str,
    member: str,
    held: SideGroup | None,
    timeout: timedelta,
) -> SideGroup:
    reply = await coordinator.GetWeightSyncGroup(
        coordinator_pb2.GetWeightSyncGroupRequest(job_id=job_id, member=member)
    )
    g = reply.group
    rendezvous = Rendezvous(g.master_address, g.master_port, g.world_size, reply.rank, g.epoch, g.backend)
    if held is not None and held.rendezvous == rendezvous:
        return held
    if held is not None:
        held.close()
    # Forming the group blocks until every member has joined: keep it off the event loop.
    return await asyncio.to_thread(SideGroup, rendezvous, timeout)
