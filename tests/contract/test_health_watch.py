"""grpc.health.v1.Health/Watch answers on every service, with and without a shared token.

Load balancers and some Kubernetes setups watch rather than check: the first message of a Watch is
SERVING for the whole server ("") and for the service's own name, and with DOCKYARD_AUTH_TOKEN set it
needs no token, as Check does.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO_ROOT

TOKEN = "watch-token"
SERVICES = {
    "buffer": "dockyard.buffer.v1.BufferService",
    "coordinator": "dockyard.coordinator.v1.CoordinatorService",
    "rollout": "dockyard.rollout.v1.RolloutService",
    "sandbox": "dockyard.sandbox.v1.SandboxService",
    "trainer": "dockyard.trainer.v1.TrainerService",
}


async def _first_watch_message(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
        try:
            return (await call.read()).status
        finally:
            call.cancel()


@pytest.mark.parametrize("token", ["", TOKEN], ids=["open", "token"])
@pytest.mark.parametrize("name", list(SERVICES))
async def test_watch_reports_serving(start_service, name: str, token: str) -> None:
    env = {"DOCKYARD_AUTH_TOKEN": token} if token else {}
    service = start_service(name, env)
    for watched in ("", SERVICES[name]):
        assert await _first_watch_message(service.address, watched) == health_pb2.HealthCheckResponse.SERVING


def test_every_service_is_watched() -> None:
    assert sorted(SERVICES) == sorted(
        p.name for p in (REPO_ROOT / "services").iterdir() if (p / "__main__.py").exists() and p.name != "endpoint"
    )
