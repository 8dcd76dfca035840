"""WarmPool.resize (warm_pool.py), which the docker backend's warm sessions are sized by: a pool fills
before its first take, shrinks by discarding what waits, and a start that ends after a shrink is not kept."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.sandbox.test_local_warm import counting_pool


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_resize_fills_a_pool_before_any_take_and_shrinks_it():
    pool, discarded = counting_pool(alive=lambda item: True, size=0)
    await settle()
    assert pool.waiting() == 0  # size 0: nothing started
    await pool.resize(3)
    await settle()
    assert (pool.size, pool.waiting()) == (3, 3)
    await pool.resize(1)
    assert pool.waiting() == 1 and sorted(discarded) == [1, 2]  # the newest waiting ones went
    assert await pool.take() == 0  # the oldest stays, and is handed out
    await settle()
    assert pool.waiting() == 1  # and is replaced up to the new size
    await pool.close()
    assert sorted(discarded) == [1, 2, 3]


async def test_a_start_that_ends_after_a_shrink_is_discarded_not_kept():
    release = asyncio.Event()
    discarded: list[int] = []
    counter = iter(range(100))

    async def start() -> int:
        await release.wait()
        return next(counter)

    async def discard(item: int) -> None:
        discarded.append(item)

    from services.sandbox.warm_pool import WarmPool

    pool = WarmPool(start, discard, alive=lambda item: True, size=0)
    await pool.resize(2)  # two starts under way
    await pool.resize(0)  # the job ended before they finished
    release.set()
    await settle()
    assert pool.waiting() == 0 and sorted(discarded) == [0, 1]
    await pool.close()


async def test_resize_refuses_a_negative_size():
    pool, _ = counting_pool(alive=lambda item: True, size=1)
    with pytest.raises(ValueError, match="0 or more"):
        await pool.resize(-1)
    await pool.close()
