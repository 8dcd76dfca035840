"""Retries are declared once: each idempotent method is retried by exactly one layer, every method
named exists in the protos, and the callers' retry waits out transient codes within its budget."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.api.trainer.v1 import trainer_pb2
from dockyard.rpc import retry as retry_module
from dockyard.rpc.retry import CALLER_RETRIED, CHANNEL_RETRIED, Backoff, channel_service_config, retry

SERVICES = {
    f.services_by_name[name].full_name: f.services_by_name[name]
    for f, name in (
        (coordinator_pb2.DESCRIPTOR, "CoordinatorService"),
        (trainer_pb2.DESCRIPTOR, "TrainerService"),
        (rollout_pb2.DESCRIPTOR, "RolloutService"),
        (buffer_pb2.DESCRIPTOR, "BufferService"),
        (sandbox_pb2.DESCRIPTOR, "SandboxService"),
    )
}


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


def test_no_method_is_retried_at_two_layers() -> None:
    for service in CHANNEL_RETRIED.keys() & CALLER_RETRIED.keys():
        assert not set(CHANNEL_RETRIED[service]) & set(CALLER_RETRIED[service]), service


@pytest.mark.parametrize("table", [CHANNEL_RETRIED, CALLER_RETRIED], ids=["channel", "caller"])
def test_every_retried_method_exists_in_the_protos(table) -> None:
    for service, methods in table.items():
        assert service in SERVICES, f"{service} is not a service of the protos"
        missing = set(methods) - set(SERVICES[service].methods_by_name)
        assert not missing, f"{service} has no {sorted(missing)}"


def test_the_channel_retries_only_its_own_methods_and_only_on_unavailable() -> None:
    config = json.loads(channel_service_config("dockyard.buffer.v1.BufferService"))
    (method_config,) = config["methodConfig"]
    assert {n["method"] for n in method_config["name"]} == {"GetStats", "GetDataPlane"}
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert json.loads(channel_service_config("dockyard.trainer.v1.TrainerService")) == {}
    assert json.loads(channel_service_config(None)) == {}


def test_backoff_doubles_up_to_its_maximum() -> None:
    assert [Backoff(initial=0.1, multiplier=2.0, maximum=0.5).delay(a) for a in range(1, 6)] == [
        0.1,
        0.2,
        0.4,
        0.5,
        0.5,
    ]


class Flaky:
    def __init__(self, failures: list[grpc.StatusCode]) -> None:
        self.failures, self.calls = list(failures), 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise rpc_error(self.failures.pop(0))
        return "ok"


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    monkeypatch.setattr(retry_module.asyncio, "sleep", sleep)
    return waited


async def test_transient_failures_are_waited_out(sleeps) -> None:
    call = Flaky([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
    assert await retry(call, what="x", budget_seconds=60) == "ok"
    assert call.calls == 3 and sleeps == [0.1, 0.2]


async def test_other_codes_are_raised_at_once(sleeps) -> None:
    call = Flaky([grpc.StatusCode.FAILED_PRECONDITION])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await retry(call, what="x", budget_seconds=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and call.calls == 1 and sleeps == []


async def test_the_last_error_is_raised_when_the_budget_is_spent() -> None:
    call = Flaky([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(retry(call, what="x", budget_seconds=0.5, backoff=Backoff(0.05, 1.0, 0.05)), 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and 3 <= call.calls < 100
