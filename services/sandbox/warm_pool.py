"""Sandboxes started ahead of their call, so a call does not wait for namespaces and an interpreter.

    WarmPool(start, discard, alive, size)
      take()   --> a waiting sandbox that is still alive, else one started now;
                   and in the background new ones started until `size` wait or are starting
      (the caller runs its one call in it, then ends it: a sandbox is never given back)
      close()  --> starts under way awaited, every waiting sandbox discarded; take() refuses after

Guarantees: each sandbox serves at most one call, so nothing one call leaves (files, processes,
environment, modules) can reach another: they share no process, namespace or folder. A waiting
sandbox has run nothing but its own setup: the call's input, limits included, reaches it only at
take()'s caller. After close() no sandbox of the pool is left: waiting ones are discarded, one
starting meanwhile is discarded once started. A failed background start is logged and dropped
(take() then starts one itself, whose failure its caller reports).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger()

T = TypeVar("T")


class WarmPool(Generic[T]):
    def __init__(
        self,
        start: Callable[[], Awaitable[T]],
        discard: Callable[[T], Awaitable[None]],
        alive: Callable[[T], bool],
        size: int,
    ) -> None:
        if size < 0:
            raise ValueError(f"size: must be 0 or more, got {size}")
        self._start, self._discard, self._alive, self._size = start, discard, alive, size
        self._waiting: list[T] = []
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    async def take(self) -> T:
        """A started sandbox for one call; raises what `start` raises when none waits."""
        if self._closed:
            raise OSError("the sandbox service is stopping")
        taken = None
        while self._waiting and taken is None:
            candidate = self._waiting.pop(0)  # the oldest: it has had the longest to start
            if self._alive(candidate):
                taken = candidate
            else:
                await self._discard(candidate)
        # Replacements start now, alongside the call: calls in a burst then find theirs under way.
        self._top_up()
        return taken if taken is not None else await self._start()

    def _top_up(self) -> None:
        while not self._closed and len(self._waiting) + len(self._starting) < self._size:
            task = asyncio.ensure_future(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        try:
            started = await self._start()
        except Exception as exc:  # noqa: BLE001 -- a warm start is an optimisation; take() starts its own
            log.warning("could not start a warm sandbox", error=f"{type(exc).__name__}: {exc}")
            return
        if self._closed:
            await self._discard(started)
        else:
            self._waiting.append(started)

    async def close(self) -> None:
        """Refuse further takes, wait for starts under way, discard every waiting sandbox."""
        self._closed = True
        if self._starting:
            await asyncio.wait(list(self._starting))
        waiting, self._waiting = self._waiting, []
        for started in waiting:
            await self._discard(started)
