"""The coordinator's job store: records round-trip, both backends keep whole documents, the
persister coalesces and retries, and a recovered weight-sync group starts past the stored epoch."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from dockyard.config import load_config_text
from dockyard.jobs import FAILED, RUNNING, SUCCEEDED
from services.coordinator.jobs import JobRecord
from services.coordinator.store import FolderStore, JobPersister, JobStore, RedisStore, open_store
from services.coordinator.weight_sync_groups import WeightSyncGroups

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32}
  train_global_batch_size: 4
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4, max_num_steps: 3}
"""


def make_record(job_id: str = "job-a") -> JobRecord:
    config = load_config_text(CONFIG)
    return JobRecord(job_id=job_id, config=config, config_yaml=config.resolved_yaml(), run_dir=f"runs/{job_id}")


def test_record_round_trips_every_field() -> None:
    record = make_record()
    record.transition(RUNNING)
    record.touch(
        step=2,
        weight_version=2,
        phase="training",
        metrics={"loss": 0.5},
        validation_metrics={"pass_rate": 0.25},
        cursor={"step": 3, "tasks_drawn_before": 16, "tasks_drawn_after": 24},
        sync_epoch=4,
    )
    back = JobRecord.from_document(json.loads(json.dumps(record.to_document())))
    assert back == record
    assert back.config == record.config and back.config.grpo.max_num_steps == 3
    assert back.to_proto() == record.to_proto()


def test_bad_documents_are_refused_by_name() -> None:
    document = make_record().to_document()
    with pytest.raises(ValueError, match="version"):
        JobRecord.from_document({**document, "version": 99})
    del document["cursor"]
    with pytest.raises(ValueError, match="cursor"):
        JobRecord.from_document(document)


def test_every_change_is_reported_transitions_as_urgent() -> None:
    seen: list[tuple[str, bool]] = []
    record = make_record()
    record.on_change = lambda r, urgent: seen.append((r.phase, urgent))
    record.touch(phase="loading policy")
    record.transition(RUNNING)
    assert seen == [("loading policy", False), ("loading policy", True)]


async def test_folder_store_replaces_whole_documents(tmp_path: Path) -> None:
    store = FolderStore(tmp_path)
    first, second = make_record("job-a"), make_record("job-b")
    await store.save("job-a", first.to_document())
    await store.save("job-b", second.to_document())
    first.transition(RUNNING)
    await store.save("job-a", first.to_document())
    assert (tmp_path / "job-a" / "job.json").is_file()
    # Only the two documents: every temp file was renamed into place.
    assert sorted(p.name for p in tmp_path.glob("*/*")) == ["job.json", "job.json"]
    loaded = {d["job_id"]: JobRecord.from_document(d) for d in await FolderStore(tmp_path).load_all()}
    assert loaded["job-a"].state == RUNNING and loaded["job-b"] == second


async def test_folder_store_a_crash_mid_write_leaves_the_previous_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FolderStore(tmp_path)
    record = make_record()
    await store.save("job-a", record.to_document())
    record.transition(RUNNING)

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        await store.save("job-a", record.to_document())
    monkeypatch.undo()
    # A crash between write and rename leaves a temp file behind at worst: never read.
    (tmp_path / "job-a" / ".job.json.partial").write_text('{"version": 1, "job_')
    (tmp_path / "job-b").mkdir()
    (tmp_path / "job-b" / "job.json").write_text("{not json")
    documents = await store.load_all()
    assert [d["job_id"] for d in documents] == ["job-a"]
    assert JobRecord.from_document(documents[0]).state != RUNNING
    assert list((tmp_path / "job-a").glob(".job.json.*")) == [tmp_path / "job-a" / ".job.json.partial"]


async def test_folder_store_of_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert await FolderStore(tmp_path / "nowhere").load_all() == []


async def test_redis_store_keeps_documents_in_one_hash(redis_server: str) -> None:
    store = RedisStore(redis_server, key="dockyard:test:jobs")
    try:
        await store._redis.delete("dockyard:test:jobs")
        record = make_record()
        await store.save("job-a", record.to_document())
        record.transition(RUNNING)
        record.touch(step=1, cursor={"step": 2, "tasks_drawn_before": 1, "tasks_drawn_after": 2})
        await store.save("job-a", record.to_document())
        await store._redis.hset("dockyard:test:jobs", "job-x", b"{broken")
        again = RedisStore(redis_server, key="dockyard:test:jobs")
        documents = await again.load_all()
        await again.close()
        assert [JobRecord.from_document(d) for d in documents] == [record]
    finally:
        await store._redis.delete("dockyard:test:jobs")
        await store.close()


def test_redis_password_never_shows() -> None:
    described = open_store("runs", "redis://user:s3cret@db.example:6380/2").describe()
    assert "s3cret" not in described and "***" in described and "db.example:6380" in described
    assert isinstance(open_store("runs", ""), FolderStore)


class FlakyStore(JobStore):
    """Fails the first `failures` saves, then keeps what it is given; counts every save."""

    def __init__(self, failures: int = 0, delay: float = 0.0) -> None:
        self.failures = failures
        self.delay = delay
        self.saves = 0
        self.documents: dict[str, dict] = {}

    def describe(self) -> str:
        return "flaky"

    async def save(self, job_id, document) -> None:
        self.saves += 1
        await asyncio.sleep(self.delay)
        if self.saves <= self.failures:
            raise ConnectionError("store down")
        self.documents[job_id] = document

    async def load_all(self):
        return list(self.documents.values())


async def test_persister_coalesces_changes_into_the_latest_state() -> None:
    store = FlakyStore(delay=0.05)
    persister = JobPersister(store)
    record = make_record()
    persister.track(record)
    for step in range(1, 51):
        record.touch(step=step)
    assert await persister.flush(5)
    assert store.documents["job-a"]["step"] == 50
    assert store.saves <= 3, "50 touches while a write was in flight should coalesce"
    await persister.close()


async def test_persister_retries_a_failed_write_and_never_raises() -> None:
    store = FlakyStore(failures=2)
    persister = JobPersister(store, retry_seconds=0.01)
    record = make_record()
    persister.track(record)
    record.transition(RUNNING)
    record.transition(SUCCEEDED)
    assert await persister.flush(5)
    assert store.documents["job-a"]["state"] == "SUCCEEDED"
    assert store.saves >= 3
    await persister.close()


async def test_persister_flush_gives_up_after_its_timeout() -> None:
    store = FlakyStore(failures=10**6)
    persister = JobPersister(store, retry_seconds=0.01, max_retry_seconds=0.02)
    record = make_record()
    persister.track(record)
    record.transition(FAILED, "x")
    assert not await persister.flush(0.2)
    assert store.documents == {} and store.saves > 2
    await persister.close(timeout=0.05)


def test_recovered_side_group_starts_past_the_stored_epoch() -> None:
    registry = WeightSyncGroups("127.0.0.1", port_fn=lambda host: 12345)
    registry.open("job-a", "gloo", epoch=5)
    group, rank = registry.get("job-a", "trainer")
    assert (group.epoch, rank) == (5, 0)
    group, _ = registry.get("job-a", "rollout", failed_epoch=5)
    assert group.epoch == 6
