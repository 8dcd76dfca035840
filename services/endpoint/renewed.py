"""A value the endpoint reads from the coordinator (a job's state, the fleet's members), renewed in the background.

    get() ──nothing held (never read, forgotten, or the last renewal failed)──> waits for a read
          ──held, read over `period` ago──> the value held at once; a renewal starts unless one runs
          ──held──> the value held

Guarantees: at most one read runs at a time, however many callers ask; a caller waits only while nothing is
held, never for a renewal, so a busy coordinator slows no call once the value is held; what a caller gets was
read at most `period` plus one read's time before. A renewal that fails drops the value, so the next caller reads
again and gets that read's error; `forget` drops it too, and a read already running then keeps nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Renewed(Generic[T]):
    def __init__(self, read: Callable[[], Awaitable[T]], period: float) -> None:
        self._read, self._period = read, period
        self._held: tuple[float, T] | None = None  # (when its read started, the value)
        self._reading: asyncio.Task[T] | None = None
        self._forgotten = 0  # forget() calls so far: a read started before the last one keeps nothing

    async def get(self) -> T:
        while self._held is None:  # again if the value read was forgotten meanwhile
            # Shielded: a caller that goes away leaves the read to the others waiting for it.
            await asyncio.shield(self._start())
        read_at, value = self._held
        if time.monotonic() - read_at > self._period:
            self._start()
        return value

    def forget(self) -> None:
        """Drop the value (it is known to be out of date): the next caller waits for a new read."""
        self._held = None
        self._forgotten += 1

    def _start(self) -> asyncio.Task[T]:
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._renew())
            # A renewal nobody awaits fails quietly: the next caller's own read raises its error.
            self._reading.add_done_callback(lambda task: task.cancelled() or task.exception())
        return self._reading

    async def _renew(self) -> T:
        started, forgotten = time.monotonic(), self._forgotten
        try:
            value = await self._read()
        except BaseException:
            self._held = None
            raise
        finally:
            self._reading = None
        if forgotten == self._forgotten:
            self._held = (started, value)
        return value
