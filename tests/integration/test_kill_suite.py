"""A job outlives the loss of any one member: each one SIGKILLed mid-job and started again.

    between steps:    rollout (the only replica), sandbox (the only worker), trainer, Redis (under the buffer)
    during training:  Redis, the buffer service, the trainer, killed while the trainer is inside a step
        × sync and async GRPO
    ─> the job SUCCEEDS, the books close (nothing lost, nothing trained twice), sync trains at age 0

"During training" waits for the trainer's "training step" log line of step 2 or later and kills at
once; a killed store (Redis, the buffer) comes back only once the trainer's ack of that step has
failed against it ("ack deferred"), so every such case proves the ack waited out the outage and the
buffer's clock caught up (no put "from the future", no async lock-up).

Real processes (LocalStack), a real redis-server under the buffer, whose data plane carries every
payload (staged by the coordinator, read by the trainer; asserted), the tiny recipe on a random-init
model. The buffer process between steps and the coordinator have kill tests of their own
(tests/integration/test_restarts.py, tests/integration/test_coordinator_restart.py). Each run prints
how long the job took from the kill to its next trained step (`pytest -s` shows it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dockyard.api.coordinator.v1 import coordinator_pb2
from dockyard.stack import LocalStack
from tests.conftest import RedisServer, redis_binary
from tests.integration.books import assert_accounted
from tests.integration.test_restarts import ASYNC, submit, succeeded, wait_for

pytestmark = pytest.mark.slow

ENV = {
    "DOCKYARD_ROLLOUT_HEARTBEAT_SECONDS": "0.5",
    "DOCKYARD_SANDBOX_HEARTBEAT_SECONDS": "0.5",
    "DOCKYARD_ROLLOUT_WEIGHT_SYNC_TIMEOUT_SECONDS": "20",
    "DOCKYARD_TRAINER_WEIGHT_SYNC_TIMEOUT_SECONDS": "20",
    "DOCKYARD_ROLLOUT_NUM_THREADS": "1",
    "DOCKYARD_TRAINER_NUM_THREADS": "1",
}
STEPS = 5
LOG_POLL_SECONDS = 0.02


def wait_for_log(path: Path, offset: int, match: Callable[[dict], bool], timeout: float = 120.0) -> tuple[dict, int]:
    """The first JSON line of `path` after byte `offset` that `match`es, and the offset after it."""
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes()
        while (end := data.find(b"\n", offset)) != -1:
            line, offset = data[offset:end], end + 1
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and match(record):
                return record, offset
        assert time.monotonic() < deadline, f"no matching line in {path.name} after {timeout:.0f} s"
        time.sleep(LOG_POLL_SECONDS)


def kill_during_training(stack: LocalStack, redis: RedisServer, victim: str) -> int:
    """Kill `victim` while the trainer is inside step 2 or later, start it again; the last step trained before."""
    log = stack.log_dir / "trainer.log"
    started, offset = wait_for_log(log, 0, lambda r: r.get("event") == "training step" and r.get("step", 0) >= 2)
    if victim == "redis":
        redis.kill()
    else:
        stack.kill(victim)
    if victim != "trainer":
        # Down until the trainer's ack of this very step has failed against it, then back.
        deferred, _ = wait_for_log(log, offset, lambda r: r.get("event", "").startswith("ack deferred"))
        assert deferred["weight_version"] == started["step"], deferred
    if victim == "redis":
        redis.start()
    else:
        stack.restart(victim)
    return started["step"] - 1


@pytest.mark.parametrize(
    ("victim", "mode", "timing"),
    [
        ("rollout", "sync", "between steps"),
        ("rollout", "async", "between steps"),
        ("sandbox", "sync", "between steps"),
        ("sandbox", "async", "between steps"),
        ("trainer", "sync", "between steps"),
        ("redis", "sync", "between steps"),
        ("redis", "async", "between steps"),
        ("redis", "sync", "during training"),
        ("redis", "async", "during training"),
        ("buffer", "sync", "during training"),
        ("buffer", "async", "during training"),
        ("trainer", "sync", "during training"),
        ("trainer", "async", "during training"),
    ],
)
def test_a_job_outlives_one_member_killed_and_restarted(tmp_path: Path, victim: str, mode: str, timing: str) -> None:
    (tmp_path / "redis").mkdir()
    redis = RedisServer(redis_binary(), tmp_path / "redis")
    redis.start()
    env = {**ENV, "DOCKYARD_BUFFER_BACKEND": "redis", "DOCKYARD_BUFFER_REDIS_URL": redis.url}
    stack = LocalStack(tmp_path / "logs", free_ports=True, extra_env=env)
    stack.start()
    try:
        overrides = (ASYNC if mode == "async" else []) + [f"grpo.max_num_steps={STEPS}", f"logger.log_dir={tmp_path}"]
        job_id = submit(stack, overrides)
        if timing == "during training":
            killed_at, killed_step = time.monotonic(), kill_during_training(stack, redis, victim)
        else:
            job = wait_for(stack, job_id, lambda j: j.step >= 2)
            assert job.state == coordinator_pb2.JOB_STATE_RUNNING, job.message
            killed_at, killed_step = time.monotonic(), job.step
            if victim == "redis":
                redis.kill()
                time.sleep(2.0)  # puts, samples and acks fail meanwhile: UNAVAILABLE, waited out
                redis.start()
            else:
                stack.kill(victim)
                time.sleep(1.0)
                stack.restart(victim)
        job = wait_for(stack, job_id, lambda j: j.step > killed_step)
        recovered = time.monotonic() - killed_at
        job = wait_for(stack, job_id, succeeded)
        assert succeeded(job), job.message
        print(f"\n{victim} killed {timing} in {mode} mode after step {killed_step}: next step {recovered:.1f} s later")
    finally:
        stack.stop()
        redis.kill()
    books = assert_accounted(tmp_path / job_id, max_age=0 if mode == "sync" else 1)
    steps = [line["step"] for line in books["ledger"]]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and steps[-1] == STEPS
    # Every payload went around the buffer service, through its Redis (the data plane): staged by the
    # rollout replicas, or, for a group generated while Redis was down, by the coordinator.
    records = [json.loads(line) for line in (tmp_path / job_id / "metrics.jsonl").read_text().splitlines()]
    sent = [r for r in records if "buffer_sent_staged_bytes" in r][-1]
    assert sent["buffer_sent_rollout_staged_bytes"] > 0 and sent["buffer_sent_payload_bytes"] == 0, sent
