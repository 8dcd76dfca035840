"""LoopHandoff: a thread's items reach the loop in order, each once, the items posted before the loop
takes them on one wake-up."""

from __future__ import annotations

import asyncio
import threading

from services.rollout.handoff import LoopHandoff


def test_items_arrive_in_order_once_and_share_wake_ups() -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        loop = asyncio.get_running_loop()
        wakes = []
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakes.append(1)
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        handoff = LoopHandoff(loop)
        evens: list[int] = []
        odds: list[int] = []

        def step(first: int) -> None:  # a decode step's tokens for eight streams
            for i in range(first, first + 8):
                handoff.post((evens if i % 2 == 0 else odds).append, i)

        counts = []
        for first in (0, 8):
            # The scheduler thread posts while the loop is busy (blocked here), as during a decode step.
            thread = threading.Thread(target=step, args=(first,))
            thread.start()
            thread.join()
            for _ in range(3):
                await asyncio.sleep(0)
            counts.append(len(wakes))
        return evens, odds, counts

    evens, odds, counts = asyncio.run(main())
    assert evens == [0, 2, 4, 6, 8, 10, 12, 14] and odds == [1, 3, 5, 7, 9, 11, 13, 15]
    assert counts == [1, 2]  # one wake-up per step, and a step after a drain wakes the loop again


def test_an_item_posted_after_the_loop_closed_is_dropped_quietly() -> None:
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff(loop)
    got: list[int] = []
    handoff.post(got.append, 1)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    handoff.post(got.append, 2)  # nobody reads any more: no error in the scheduler thread
    assert got == [1]
