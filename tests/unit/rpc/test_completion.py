"""A handler's work outlives a caller that goes away, and keeps its lock until it is done."""

from __future__ import annotations

import asyncio

import pytest

from dockyard.rpc.completion import run_to_completion


async def test_work_goes_on_after_its_caller_is_cancelled() -> None:
    lock = asyncio.Lock()
    steps: list[str] = []

    async def step() -> int:
        async with lock:
            steps.append("started")
            await asyncio.sleep(0.2)
            steps.append("trained")
            await asyncio.sleep(0.05)
            steps.append("acked")
            return 7

    caller = asyncio.create_task(run_to_completion(step()))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    # The caller is gone at once; the lock is still held by the work it started.
    assert steps == ["started"] and lock.locked()
    async with lock:
        assert steps == ["started", "trained", "acked"]


async def test_results_and_errors_reach_a_caller_that_stays() -> None:
    async def ok() -> str:
        return "done"

    async def bad() -> None:
        raise ValueError("refused")

    assert await run_to_completion(ok()) == "done"
    with pytest.raises(ValueError, match="refused"):
        await run_to_completion(bad())
