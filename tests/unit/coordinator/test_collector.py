"""The collector's contract with the buffer (JobBuffer.put) and the sandbox, against stand-in stubs."""

from __future__ import annotations

import grpc
import pytest

from dockyard.api.buffer.v1 import buffer_pb2
from dockyard.api.common.v1 import common_pb2
from services.coordinator.job_buffer import JobBuffer
from services.coordinator.rewards import reward_of
from tests.conftest import make_group


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FullThenFree:
    """A buffer that answers `code` (RESOURCE_EXHAUSTED: full) `full` times, then accepts."""

    def __init__(
        self, full: int, then: grpc.StatusCode | None = None, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    ) -> None:
        self.calls, self.full, self.then, self.code = 0, full, then, code

    async def PutGroupStream(self, chunks, timeout=None):
        assert next(iter(chunks)).group.group_id  # the first chunk carries the group
        self.calls += 1
        if self.calls <= self.full:
            raise rpc_error(self.code)
        if self.then is not None:
            raise rpc_error(self.then)
        return buffer_pb2.PutGroupStreamResponse()


async def test_a_full_buffer_is_waited_out_with_backoff() -> None:
    buffer = FullThenFree(full=3)
    reply = await JobBuffer(buffer, "job").put(make_group("g"), max_wait=10)
    assert reply == buffer_pb2.PutGroupStreamResponse() and buffer.calls == 4


async def test_a_buffer_full_for_too_long_fails_the_put() -> None:
    buffer = FullThenFree(full=1000)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await JobBuffer(buffer, "job").put(make_group("g"), max_wait=0.25)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 2 <= buffer.calls < 10


async def test_an_unreachable_buffer_is_waited_out_like_a_full_one() -> None:
    buffer = FullThenFree(full=2, code=grpc.StatusCode.UNAVAILABLE)
    reply = await JobBuffer(buffer, "job").put(make_group("g"), max_wait=10)
    assert reply == buffer_pb2.PutGroupStreamResponse() and buffer.calls == 3


async def test_other_errors_are_not_retried_by_the_put() -> None:
    buffer = FullThenFree(full=0, then=grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(grpc.aio.AioRpcError):
        await JobBuffer(buffer, "job").put(make_group("g"), max_wait=10)
    assert buffer.calls == 1


@pytest.mark.parametrize(
    ("status", "passed", "total", "kind", "expected"),
    [
        (common_pb2.VERDICT_STATUS_PASSED, 8, 8, "pass_fraction", (1.0, True)),
        (common_pb2.VERDICT_STATUS_FAILED, 3, 8, "pass_fraction", (0.375, True)),
        (common_pb2.VERDICT_STATUS_FAILED, 3, 8, "all_pass", (0.0, True)),
        (common_pb2.VERDICT_STATUS_TIMEOUT, 0, 8, "pass_fraction", (0.0, True)),
        # An infrastructure failure is masked, never a zero reward.
        (common_pb2.VERDICT_STATUS_ERROR, 0, 0, "pass_fraction", (0.0, False)),
    ],
)
def test_reward_of_a_verdict(status, passed, total, kind, expected) -> None:
    verdict = common_pb2.Verdict(status=status, tests_passed=passed, tests_total=total)
    assert reward_of(verdict, kind) == expected
