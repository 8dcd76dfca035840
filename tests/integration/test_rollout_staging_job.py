"""A job on real processes (LocalStack) with the Redis buffer: the rollout stages every group's payload in
the data plane and the coordinator carries metadata only; with the buffer in memory, the payloads go
through the coordinator as before. Both train, and the books of the run add up (tests/integration/books.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from dockyard.stack import LocalStack
from tests.integration.books import assert_accounted
from tests.integration.test_restarts import submit, succeeded, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["redis", "memory"])
def test_payloads_leave_from_the_rollout_with_a_data_plane(tmp_path: Path, backend: str, request) -> None:
    env = {}
    if backend == "redis":
        url = request.getfixturevalue("redis_server")
        redis.Redis.from_url(url).flushdb()
        env = {"DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": url}
    stack = LocalStack(tmp_path / "logs", free_ports=True, extra_env=env)
    stack.start()
    try:
        job_id = submit(stack, ["grpo.max_num_steps=3", f"logger.log_dir={tmp_path}"])
        job = wait_for(stack, job_id, succeeded)
    finally:
        stack.stop()
    assert succeeded(job), job.message
    books = assert_accounted(tmp_path / job_id, max_age=0)
    assert [line["step"] for line in books["ledger"]] == [1, 2, 3]
    final = [r for r in books["records"] if r["kind"] == "buffer"][-1]
    if backend == "redis":
        # Not one token array reached the coordinator: each payload went rollout -> Redis -> trainer.
        assert final["coordinator_received_arrays_bytes"] == 0
        assert final["coordinator_received_rollout_staged_bytes"] > 0
        assert final["buffer_sent_payload_bytes"] == final["buffer_sent_staged_bytes"] == 0
        assert final["buffer_sent_rollout_staged_bytes"] > 0
    else:
        assert final["coordinator_received_arrays_bytes"] > 0
        assert final["coordinator_received_rollout_staged_bytes"] == 0
        assert final["buffer_sent_payload_bytes"] > 0 and final["buffer_sent_rollout_staged_bytes"] == 0
