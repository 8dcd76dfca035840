"""Sandboxes started ahead of their call, so a call does not wait for namespaces and an interpreter.

    WarmPool(start, discard, alive, size, reuse=False)
      take()   --> a waiting sandbox that is still alive, else one started now;
                   and in the background new ones started until `size` wait, are starting or
                   (reuse) are out at a call (take(top_up=False): not now, but at the caller's top_up(),
                   e.g. once its call ended, so the starts do not compete with the call for the CPU)
      one-call pool (reuse=False): the caller runs its one call in it, then ends it; never given back
      reusable pool: give_back(sandbox, reusable) --> waiting again when `reusable`, alive and within
                   `size`; discarded otherwise
      resize(n) --> `size` becomes n: waiting sandboxes beyond it discarded, new ones started up to it
                   (resize to the same size fills a pool no take() has filled yet)
      close()  --> starts under way awaited, every waiting sandbox discarded; take() refuses after,
                   and a sandbox given back then is discarded

Guarantees: a one-call pool's sandbox serves at most one call, so nothing one call leaves (files,
processes, environment, modules) can reach another: they share no process, namespace or folder. A
reusable pool holds a sandbox only while the caller says it was reset (local_workers.py); it gives
no sandbox to two callers at once. A waiting sandbox has run nothing but its own setup (and, reused,
earlier calls it was reset after): the call's input, limits included, reaches it only at take()'s
caller. After close() no sandbox of the pool is left: waiting ones are discarded, one starting
meanwhile is discarded once started. A failed background start is logged and dropped (take() then
starts one itself, whose failure its caller reports).
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
        *,
        reuse: bool = False,
    ) -> None:
        if size < 0:
            raise ValueError(f"size: must be 0 or more, got {size}")
        self._start, self._discard, self._alive, self._size = start, discard, alive, size
        self._reuse = reuse
        self._waiting: list[T] = []
        self._starting: set[asyncio.Task[None]] = set()
        self._out = 0  # reusable sandboxes taken and not yet given back
        self._closed = False

    async def take(self, *, top_up: bool = True) -> T:
        """A started sandbox for a call; raises what `start` raises when none waits. Replacements start now,
        or with `top_up=False` at the caller's top_up()."""
        if self._closed:
            raise OSError("the sandbox service is stopping")
        taken = None
        while self._waiting and taken is None:
            candidate = self._waiting.pop(0)  # the oldest: it has had the longest to start
            if self._alive(candidate):
                taken = candidate
            else:
                await self._discard(candidate)
        if self._reuse:
            self._out += 1
        # Replacements start now, alongside the call: calls in a burst then find theirs under way.
        if top_up:
            self._top_up()
        if taken is not None:
            return taken
        try:
            return await self._start()
        except BaseException:
            if self._reuse:
                self._out -= 1
            raise

    async def give_back(self, taken: T, *, reusable: bool) -> None:
        """A reusable pool's sandbox back from its call: waiting again when `reusable` (its caller saw it
        reset), still alive and within `size`; discarded otherwise."""
        if not self._reuse:
            raise ValueError("give_back: this pool's sandboxes serve one call each")
        self._out -= 1
        held = len(self._waiting) + len(self._starting) + self._out
        if reusable and not self._closed and held < self._size and self._alive(taken):
            self._waiting.append(taken)
        else:
            await self._discard(taken)
            self._top_up()

    @property
    def size(self) -> int:
        return self._size

    def waiting(self) -> int:
        """Sandboxes started and waiting for a take()."""
        return len(self._waiting)

    async def resize(self, size: int) -> None:
        """Hold `size` sandboxes from now on: the newest waiting ones beyond it are discarded, and starts
        begin in the background up to it (a fresh pool fills here, before its first take())."""
        if size < 0:
            raise ValueError(f"size: must be 0 or more, got {size}")
        self._size = size
        while self._waiting and len(self._waiting) + len(self._starting) + self._out > size:
            await self._discard(self._waiting.pop())
        self._top_up()

    def top_up(self) -> None:
        """Start sandboxes in the background until `size` wait, are starting or are out."""
        self._top_up()

    def _top_up(self) -> None:
        while not self._closed and len(self._waiting) + len(self._starting) + self._out < self._size:
            task = asyncio.ensure_future(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        try:
            started = await self._start()
        except Exception as exc:  # noqa: BLE001 -- a warm start is an optimisation; take() starts its own
            log.warning("could not start a warm sandbox", error=f"{type(exc).__name__}: {exc}")
            return
        if self._closed or len(self._waiting) + self._out >= self._size:  # closed, or shrunk meanwhile
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
