"""Backpressure in front of the backend: a bounded number of running and of waiting calls.

    call --> running < max_running ----------------------> runs now
         --> else waiting < max_queued --> waits (FIFO) --> runs
         --> else ResourceExhausted (RESOURCE_EXHAUSTED): the caller backs off and retries

The queue never grows without bound, so a burst of callers cannot pile up
memory or deadlines inside the service; they learn at once that it is full.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from dockyard.rpc.errors import ResourceExhausted


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self._max_running = max_running
        self._max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)
        self._waiting = 0
        self._running = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one running slot for the body; ResourceExhausted when the queue is full."""
        if self._slots.locked() and self._waiting >= self._max_queued:
            raise ResourceExhausted(
                f"sandbox is full: {self._max_running} runs executing and {self._waiting} waiting "
                f"(max_queued={self._max_queued}); retry later"
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._slots.release()
