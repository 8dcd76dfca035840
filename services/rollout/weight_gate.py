"""The weight gate: decode steps share the weights, an update takes them alone between two steps.

Guarantees: an update never overlaps a decode step (or a prefill) of the scheduler; a waiting update
has priority over new steps (`waiting` tells the scheduler to admit no new request), so a stream of
requests cannot starve it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WeightGate:
    """The scheduler holds the weights while it computes; an update takes them between two decode steps.

    A waiting update has priority: `waiting` tells the scheduler to admit no new request.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = self._writers_waiting = 0
        self._writer = False

    def enter(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._active += 1

    def exit(self) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    @property
    def waiting(self) -> bool:
        return self._writers_waiting > 0

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        with self._cv:
            self._writers_waiting += 1
            self._cv.wait_for(lambda: self._active == 0 and not self._writer)
            self._writers_waiting -= 1
            self._writer = True
        with self._held():
            yield

    def update_now(self) -> contextlib.AbstractContextManager[None] | None:
        """`updating`'s hold if the weights are free at once (no step, no other update waiting or holding),
        else None: it never waits, so an event loop may call it. Enter what it returns at once."""
        with self._cv:
            if self._active or self._writer or self._writers_waiting:
                return None
            self._writer = True
        return self._held()

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()
