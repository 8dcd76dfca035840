"""A Redis that goes away under the buffer is UNAVAILABLE (callers retry), never INTERNAL, and
once it is back, with its AOF, the buffer goes on where it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from dockyard.rpc.errors import Unavailable
from services.buffer.redis_backend import RedisBuffer
from tests.conftest import RedisServer, make_group, redis_binary

JOB = "job-outage"


@pytest.fixture
def own_redis(tmp_path: Path):
    server = RedisServer(redis_binary(), tmp_path)
    server.start()
    yield server
    server.kill()


async def test_a_lost_redis_is_unavailable_and_the_buffer_resumes_when_it_is_back(own_redis: RedisServer) -> None:
    buffer = await RedisBuffer.connect(own_redis.url)
    try:
        await buffer.open_job(JOB, 10, 1)
        assert await buffer.put_group(make_group("g0", 0, job_id=JOB)) == (False, False)
        own_redis.kill()
        for call in (
            lambda: buffer.put_group(make_group("g1", 0, job_id=JOB)),
            lambda: buffer.sample(JOB, "t0", 0, 4, 1 << 20),
            lambda: buffer.ack(JOB, ["g0"], 1),
            lambda: buffer.stats(JOB),
            lambda: buffer.open_job(JOB, 10, 1, rewind_to=0),
        ):
            with pytest.raises(Unavailable, match="cannot reach its Redis"):
                await call()
        own_redis.start()
        groups, _ = await buffer.sample(JOB, "t0", 0, 4, 1 << 20)
        assert [g.group_id for g in groups] == ["g0"]  # fsynced before the kill, so it survived
    finally:
        await buffer.close()
