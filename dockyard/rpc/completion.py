"""Work that must run to its end even when the caller goes away.

grpc.aio cancels a handler when its client disconnects (a coordinator that
dies mid-call). For a call that changes state in steps (train, then ack;
send weights while holding the job's lock) a cancelled handler would leave
the state half-changed and release its lock while a worker thread still runs.

Guarantees: `run_to_completion(coro)` runs `coro` as a task of its own; if the
caller is cancelled the caller sees CancelledError at once, but the task goes
on to its end (holding whatever locks it took), and its outcome is logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger()
T = TypeVar("T")

# Strong references: the event loop keeps only weak ones to running tasks.
_detached: set[asyncio.Task] = set()


def _report(task: asyncio.Task) -> None:
    _detached.discard(task)
    if task.cancelled():
        log.warning("work of a departed caller was cancelled")
    elif task.exception() is not None:
        log.warning("work of a departed caller failed", error=f"{type(task.exception()).__name__}: {task.exception()}")
    else:
        log.info("work of a departed caller completed; its reply was dropped")


async def run_to_completion(coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            _detached.add(task)
            task.add_done_callback(_report)
        raise
