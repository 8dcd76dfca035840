"""A member's registration loop against an in-process coordinator: it registers once the
coordinator is up (not crashing while it is down), heartbeats its load, registers again after a
coordinator restart (NOT_FOUND), and unregisters when it stops."""

from __future__ import annotations

import asyncio

import grpc

from dockyard.api.coordinator.v1 import coordinator_pb2_grpc
from dockyard.rpc.membership import Membership
from dockyard.rpc.server import RpcContextInterceptor
from services.coordinator.servicer import CoordinatorServicer
from services.coordinator.settings import CoordinatorSettings
from tests.conftest import free_port


async def start_coordinator(port: int) -> tuple[grpc.aio.Server, CoordinatorServicer]:
    servicer = CoordinatorServicer(CoordinatorSettings(member_timeout_seconds=5))
    server = grpc.aio.server(interceptors=[RpcContextInterceptor()])
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server, servicer


async def until(condition, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_register_heartbeat_reregister_after_a_coordinator_restart_and_leave():
    port = free_port()
    member = Membership(f"127.0.0.1:{port}", "sandbox", "sandbox-7", "127.0.0.1:9", 0.1, lambda: (3, 2, 1))
    member.start()
    await asyncio.sleep(0.5)  # no coordinator yet: retried quietly
    assert not member.registered and not member._task.done()

    server, servicer = await start_coordinator(port)
    await until(lambda: servicer.fleet.get("sandbox-7") is not None)
    worker = servicer.fleet.get("sandbox-7")
    assert worker.address == "127.0.0.1:9"
    await until(lambda: (worker.load, worker.running, worker.queued) == (3, 2, 1))
    await server.stop(0)
    await servicer.close()

    # A new coordinator knows nothing: the member's heartbeat is NOT_FOUND and it registers again.
    server, servicer = await start_coordinator(port)
    await until(lambda: servicer.fleet.get("sandbox-7") is not None)
    # The coordinator holds it before the member has read the reply that counts it: wait for that too.
    await until(lambda: member.registrations >= 2)
    assert member.registrations == 2

    await member.stop()
    assert servicer.fleet.get("sandbox-7") is None
    await server.stop(0)
    await servicer.close()
