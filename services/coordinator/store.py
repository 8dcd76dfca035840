"""Where the coordinator keeps its jobs, so that a restarted coordinator finds them again.

    JobRecord.touch/transition ─on_change─> JobPersister (dirty ids, one writer task)
        ─to_document─> JSON ─> FolderStore  <state_dir>/<job_id>/job.json   (temp file + fsync + os.replace)
                              RedisStore   HSET dockyard:coordinator:jobs <job_id> <json>
    coordinator start ─load_all─> documents ─> JobRecord.from_document

Guarantees: a stored document is always whole (the folder store replaces the
file atomically; a Redis HSET is atomic), so a crash at any moment leaves the
last complete write or the one before it; the persister never blocks the
event loop on I/O and never raises into a job: a failed write is logged as an
error and retried with backoff until it lands; writes are coalesced (a job
touched many times while one write is in flight is written once more, with
its latest state); `flush` returns once every change made before it is
stored. A Redis password (in the URL or given apart) is never logged, and a
refused one is explained by the variable to set (dockyard/redis_url.py).
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import structlog

from dockyard.redis_url import explain_auth_failure, mask_secret, mask_url
from services.coordinator.jobs import JobRecord

log = structlog.get_logger()

REDIS_KEY = "dockyard:coordinator:jobs"
DOCUMENT_NAME = "job.json"


class JobStore(abc.ABC):
    """One JSON document per job id."""

    @abc.abstractmethod
    async def save(self, job_id: str, document: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def load_all(self) -> list[dict[str, Any]]:
        """Every stored document that parses; an unreadable one is logged and left out."""

    async def close(self) -> None:
        return None

    @abc.abstractmethod
    def describe(self) -> str: ...


class FolderStore(JobStore):
    """`<root>/<job_id>/job.json`; with the default root ("runs") that is the job's run folder."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return f"folder {self.root}"

    def _write(self, job_id: str, text: str) -> None:
        folder = self.root / job_id
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{DOCUMENT_NAME}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / DOCUMENT_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        # The rename itself is durable only once the folder's entry is on disk.
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    async def save(self, job_id: str, document: dict[str, Any]) -> None:
        await asyncio.to_thread(self._write, job_id, json.dumps(document))

    def _read_all(self) -> list[dict[str, Any]]:
        documents = []
        for path in sorted(self.root.glob(f"*/{DOCUMENT_NAME}")):
            try:
                documents.append(_document(path.read_text()))
            except (OSError, ValueError) as exc:
                log.error("unreadable job document left out", path=str(path), error=str(exc))
        return documents

    async def load_all(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._read_all)


class RedisStore(JobStore):
    """One hash, field job id -> JSON document."""

    PASSWORD_VARIABLE = "DOCKYARD_COORDINATOR_STATE_REDIS_PASSWORD"

    def __init__(self, url: str, key: str = REDIS_KEY, password: str | None = None) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.key = key
        self._password = password
        # Bounded calls: a black-holed Redis makes a write fail (and be retried), not hang the writer.
        self._redis = aioredis.Redis.from_url(url, password=password, socket_timeout=10, socket_connect_timeout=10)

    def describe(self) -> str:
        return f"redis {mask_url(self.url)} key {self.key}"

    async def save(self, job_id: str, document: dict[str, Any]) -> None:
        await self._redis.hset(self.key, job_id, json.dumps(document))

    async def load_all(self) -> list[dict[str, Any]]:
        from redis.exceptions import AuthenticationError, RedisError

        try:
            stored = await self._redis.hgetall(self.key)
        except AuthenticationError as exc:
            raise explain_auth_failure(self.url, self._password, self.PASSWORD_VARIABLE, exc) from None
        except (RedisError, OSError) as exc:
            raise RuntimeError(mask_secret(str(exc), self._password)) from None
        documents = []
        for field, value in sorted(stored.items()):
            try:
                documents.append(_document(value))
            except ValueError as exc:
                log.error("unreadable job document left out", key=self.key, field=field.decode(), error=str(exc))
        return documents

    async def close(self) -> None:
        await self._redis.aclose()


def _document(text: str | bytes) -> dict[str, Any]:
    """A stored job's JSON object; ValueError for anything else, so it is left out with a log line."""
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ValueError(f"a job document is a JSON object, not {type(document).__name__}")
    return document


def open_store(state_dir: str, redis_url: str, redis_password: str | None = None) -> JobStore:
    """Redis when a URL is given, the folder otherwise."""
    return RedisStore(redis_url, password=redis_password) if redis_url else FolderStore(state_dir)


class JobPersister:
    """Writes records to a store in the background: coalesced, retried, never raising into a job."""

    def __init__(self, store: JobStore, *, retry_seconds: float = 0.5, max_retry_seconds: float = 10.0) -> None:
        self.store = store
        self._records: dict[str, JobRecord] = {}
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._retry = retry_seconds
        self._max_retry = max_retry_seconds
        self._task: asyncio.Task | None = None

    def track(self, record: JobRecord, *, write: bool = True) -> None:
        """Persist `record` on every change, and now unless `write` is False (it was just loaded)."""
        self._records[record.job_id] = record
        record.on_change = self.changed
        if write:
            self.changed(record, True)

    def changed(self, record: JobRecord, urgent: bool = False) -> None:
        # Urgent or not, the same path: one writer, the latest state; `urgent` is for callers
        # that flush after a transition.
        self._dirty.add(record.job_id)
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._writer())

    async def _writer(self) -> None:
        delay = self._retry
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                job_id = next(iter(self._dirty))
                self._dirty.discard(job_id)
                document = self._records[job_id].to_document()
                try:
                    await self.store.save(job_id, document)
                    delay = self._retry
                except Exception as exc:  # noqa: BLE001 - any store failure is retried, never fatal
                    self._dirty.add(job_id)
                    log.error(
                        "persisting job state failed; retrying",
                        job_id=job_id,
                        store=self.store.describe(),
                        error=f"{type(exc).__name__}: {exc}",
                        retry_in=delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._max_retry)
            if not self._dirty:
                self._idle.set()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every change so far is stored; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self, timeout: float = 10.0) -> None:
        if not await self.flush(timeout):
            log.error(
                "job state not fully persisted at shutdown", store=self.store.describe(), jobs=sorted(self._dirty)
            )
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.store.close()
