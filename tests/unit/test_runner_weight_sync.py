"""The runner's weight sync: one more attempt after a side-group failure, none after anything else."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from dockyard.rollout.v1 import rollout_pb2
from dockyard.trainer.v1 import trainer_pb2
from services.coordinator.runner import SYNC_ATTEMPTS, JobRunner


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} on purpose")


def runner(push_results: list, receive_results: list) -> tuple[SimpleNamespace, dict]:
    calls = {"push": 0, "receive": 0}

    def answer(results: list, kind: str):
        async def call(request, timeout=None):
            calls[kind] += 1
            result = results.pop(0)
            if isinstance(result, BaseException):
                raise result
            return result

        return call

    stubs = SimpleNamespace(
        trainer=SimpleNamespace(PushWeights=answer(push_results, "push")),
        rollout=SimpleNamespace(ReceiveWeights=answer(receive_results, "receive")),
    )
    return SimpleNamespace(record=SimpleNamespace(job_id="job"), stubs=stubs, _slow=5.0), calls


def pushed(seconds: float = 0.5) -> trainer_pb2.PushWeightsResponse:
    return trainer_pb2.PushWeightsResponse(checksum="abc", seconds=seconds)


def received(version: int = 3, seconds: float = 0.25) -> rollout_pb2.ReceiveWeightsResponse:
    return rollout_pb2.ReceiveWeightsResponse(checksum="abc", weight_version=version, seconds=seconds)


async def test_a_side_group_failure_is_tried_again_and_then_succeeds():
    fake, calls = runner([rpc_error(grpc.StatusCode.UNAVAILABLE), pushed()], [received(), received()])
    assert await JobRunner._sync_weights(fake, 3) == 0.5
    assert calls == {"push": 2, "receive": 2}


async def test_a_sync_that_keeps_failing_raises_after_the_last_attempt():
    failures = [rpc_error(grpc.StatusCode.UNAVAILABLE) for _ in range(SYNC_ATTEMPTS)]
    fake, calls = runner(failures, [received() for _ in range(SYNC_ATTEMPTS)])
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await JobRunner._sync_weights(fake, 3)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert calls["push"] == SYNC_ATTEMPTS


async def test_other_failures_are_not_retried():
    fake, calls = runner([pushed()], [rpc_error(grpc.StatusCode.FAILED_PRECONDITION)])
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await JobRunner._sync_weights(fake, 3)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert calls == {"push": 1, "receive": 1}


async def test_checksums_that_differ_fail_the_sync():
    fake, _ = runner([pushed()], [rollout_pb2.ReceiveWeightsResponse(checksum="xyz", weight_version=3)])
    with pytest.raises(RuntimeError, match="corrupt"):
        await JobRunner._sync_weights(fake, 3)
