"""Items handed from the scheduler thread to the event loop, one wake-up for all of a decode step's.

    scheduler thread: post(put, item), post(put, item), ...  ──one call_soon_threadsafe──> loop: put(item), ...

Waking the loop from another thread writes to its self-pipe and hands it the GIL; with a wake-up per
streaming request per step that handoff cost the decode thread more than the step's sampling. Here the
first item posted while the loop has not yet drained the mailbox schedules the drain and the rest ride
along, so a step whose tokens reach many streams wakes the loop once.

Guarantees: every item posted is handed to its `put`, on the loop's thread, in the order posted (across
all `put`s); none is handed twice. Items posted after the loop closed are dropped (nobody reads any more).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


class LoopHandoff:
    """A mailbox from any thread to `loop`; `post` never blocks on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, put: Callable[[Any], None], item: Any) -> None:
        with self._lock:
            self._items.append((put, item))
            if len(self._items) > 1:  # a drain is already scheduled and will take this one too
                return
        with contextlib.suppress(RuntimeError):  # the loop closed
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for put, item in items:
            put(item)
