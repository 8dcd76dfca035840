"""Renewed: one read at a time, callers wait only while nothing is held, failures and forget() drop the value."""

from __future__ import annotations

import asyncio

import pytest

from services.endpoint.renewed import Renewed


class Source:
    """Reads that return 1, 2, 3, ... once `gate` is set (set by default); `fail` makes the next read raise."""

    def __init__(self) -> None:
        self.reads = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def read(self) -> int:
        self.reads += 1
        n = self.reads
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return n


async def test_callers_with_nothing_held_share_one_read() -> None:
    source = Source()
    source.gate.clear()
    value = Renewed(source.read, period=60)
    waiting = [asyncio.ensure_future(value.get()) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert source.reads == 1 and not any(w.done() for w in waiting)
    source.gate.set()
    assert await asyncio.gather(*waiting) == [1] * 5
    assert await value.get() == 1 and source.reads == 1  # within the period: nothing read


async def test_a_stale_value_is_served_at_once_while_one_renewal_runs() -> None:
    source = Source()
    value = Renewed(source.read, period=0)  # always stale once read
    assert await value.get() == 1
    source.gate.clear()
    # The renewal is held by the gate: callers are not, and no second read starts.
    assert [await asyncio.wait_for(value.get(), 1) for _ in range(3)] == [1, 1, 1]
    assert source.reads == 2
    source.gate.set()
    await asyncio.sleep(0.01)
    assert await value.get() == 2


async def test_a_failed_renewal_makes_the_next_caller_read_and_hear_its_error() -> None:
    source = Source()
    value = Renewed(source.read, period=0)
    assert await value.get() == 1
    source.fail = LookupError("the job is not running")
    assert await value.get() == 1  # the renewal it starts fails in the background
    await asyncio.sleep(0.01)
    with pytest.raises(LookupError, match="not running"):
        await value.get()
    source.fail = None
    assert await value.get() == 4  # reads 2 and 3 failed


async def test_a_read_running_when_the_value_is_forgotten_is_not_kept() -> None:
    source = Source()
    value = Renewed(source.read, period=60)
    assert await value.get() == 1
    value.forget()
    source.gate.clear()
    first = asyncio.ensure_future(value.get())
    await asyncio.sleep(0.01)
    value.forget()  # read 2 started before this: its value is out of date too
    source.gate.set()
    assert await first == 3 and source.reads == 3


async def test_a_caller_that_leaves_does_not_cancel_the_read_for_the_others() -> None:
    source = Source()
    source.gate.clear()
    value = Renewed(source.read, period=60)
    leaving, staying = asyncio.ensure_future(value.get()), asyncio.ensure_future(value.get())
    await asyncio.sleep(0.01)
    leaving.cancel()
    source.gate.set()
    assert await staying == 1 and source.reads == 1
