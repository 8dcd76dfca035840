"""Warm docker sessions: started session containers waiting per key, so OpenSession takes one in milliseconds.

    PrepareSessions(job, size, limits, packages, routed, images) --> prepare_job: images pulled (image_cache.py),
        the sessions' image resolved (packages: built once) --> WarmSessions.prepare: the job's share of the key's pool;
        key = (image, memory_mb, cpu_seconds, routed)   the pool's size = the sum of its jobs' shares,
                                                          at most DOCKYARD_SANDBOX_WARM_SESSIONS_MAX
        WarmPool(start) --> docker_session_start.start_session_container(work=None), the one maker of a cold
            session's container too (same create options and host config; labels owner + session + warm),
            PID 1 the reaper (routed: the forwarder, its route's folder made and mounted, the route not yet
            listening), /work an empty tmpfs; READY read, nothing else run
    OpenSession --> WarmSessions.open: a pool for the session's key?
        yes: take() --> the session's files (seed copy, then files) as a tar into /work through
             `docker exec tar -x` as the session's user --> routed: the route bound to the session's
             endpoint address and started --> DockerSession (the pool starts a replacement meanwhile)
        no:  docker_sessions.open_docker_session, a container started for the session (as without a pool)
    ReleaseSessions(job) --> its share dropped; a pool no job holds any more is closed
    close() (service stop) --> every pool closed

Per-session settings: what is fixed when a container is created (the image, the memory cgroup and
RLIMIT_CPU from the session's limits, whether /run/dockyard holds a route's folder) is the pool's key,
so a taken container has exactly the limits its session asked for, never a neighbour's; a session
whose key has no pool opens cold. What varies per session and is not in the container's config
arrives only at take: its files (copied in), its endpoint address (the route's host end is bound
then), and each command's wall-clock limit and output cap (per exec, as before).

Guarantees: a warm container is made by the same function, so the same host_config, as a cold session's (read-only
root, cap_drop ALL, no-new-privileges, network none, non-root user, pids / memory / CPU limits, the
/work tmpfs of max_disk_mb, the /tmp tmpfs) and has run nothing but its PID 1; it serves one
session and is removed with it, never given back. A container that died while waiting is never
handed out: the copy of the files into it is its liveness check (an exec into a stopped container
fails; with no files to copy, an inspect of its state), and one that fails is removed and the next
taken. After release of the last job of a key, and after close(), no warm container of that pool is
left (WarmPool.close awaits starts under way), and a service killed outright leaves them to the next
start's reaper (they carry the session label).
Every docker call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from services.sandbox.backend import ResourceLimits
from services.sandbox.docker_container import remove_container
from services.sandbox.docker_session_start import stage_session_files, start_session_container
from services.sandbox.docker_sessions import DockerSession, DockerSessionConfig, open_docker_session
from services.sandbox.endpoint_route import EndpointRoute
from services.sandbox.staging import checked_files, remove_tree
from services.sandbox.warm_pool import WarmPool

log = structlog.get_logger()

WARM_LABEL = "dockyard.sandbox.warm"  # on a container started ahead of its session
TAKE_TRIES = 3  # warm containers tried per open before the open fails (each failed one is removed)
COPY_LIMITS = ResourceLimits(timeout_seconds=120.0, memory_mb=0, cpu_seconds=0, max_output_bytes=4096)


@dataclass(frozen=True)
class WarmKey:
    """Everything of a session fixed when its container is created."""

    image: str
    memory_mb: int
    cpu_seconds: float
    routed: bool


def key_of(config: DockerSessionConfig, limits: ResourceLimits, routed: bool) -> WarmKey:
    return WarmKey(config.image, limits.memory_mb, limits.cpu_seconds, routed)


@dataclass
class _Warm:
    container_id: str
    client: object  # the engine's client, to remove the container
    route: EndpointRoute | None  # routed: made (its folder mounted), not yet bound nor listening


class WarmSessions:
    def __init__(self, max_per_key: int) -> None:
        self._max = max_per_key
        self._pools: dict[WarmKey, WarmPool[_Warm]] = {}
        self._shares: dict[WarmKey, dict[str, int]] = {}
        self._lock = asyncio.Lock()

    def sizes(self) -> dict[WarmKey, int]:
        return {key: pool.size for key, pool in self._pools.items()}

    def waiting(self) -> int:
        return sum(pool.waiting() for pool in self._pools.values())

    async def prepare(self, job_id: str, config: DockerSessionConfig, limits: ResourceLimits, routed: bool, size: int):
        """The job holds `size` warm containers of its sessions' key (0: none); returns the pool's size."""
        key = key_of(config, limits, routed)
        async with self._lock:
            shares = self._shares.setdefault(key, {})
            shares[job_id] = size
            pool = self._pools.get(key)
            if pool is None:
                pool = WarmPool(lambda: self._start(config, limits, routed), _discard, lambda _: True, 0)
                self._pools[key] = pool
            total = min(sum(shares.values()), self._max)
            await pool.resize(total)
            log.info("warm sessions", job_id=job_id, image=key.image, memory_mb=key.memory_mb, size=total)
            return total

    async def release(self, job_id: str) -> None:
        """Drop the job's shares; a pool no job holds is closed, its waiting containers removed."""
        async with self._lock:
            for key, shares in list(self._shares.items()):
                if shares.pop(job_id, None) is None:
                    continue
                pool = self._pools[key]
                if shares:
                    await pool.resize(min(sum(shares.values()), self._max))
                else:
                    del self._shares[key], self._pools[key]
                    await pool.close()
                log.info("warm sessions released", job_id=job_id, image=key.image, size=pool.size if shares else 0)

    async def close(self) -> None:
        async with self._lock:
            pools, self._pools, self._shares = list(self._pools.values()), {}, {}
            for pool in pools:
                await pool.close()

    async def open(
        self,
        config: DockerSessionConfig,
        files: Mapping[str, str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None,
        endpoint_address: str = "",
    ) -> DockerSession:
        """A session: from its key's pool when there is one, else a container started for it."""

        def cold():  # a container started for the session, as without warm sessions
            return open_docker_session(config, files, limits, seed_dir=seed_dir, endpoint_address=endpoint_address)

        key = key_of(config, limits, bool(endpoint_address))
        pool = self._pools.get(key)
        if pool is None:
            return await cold()
        checked = checked_files(files)
        # Nothing to copy in: an inspect, not an exec, tells whether the container still runs.
        archive = await asyncio.to_thread(_stage_archive, config, checked, seed_dir) if checked or seed_dir else None
        problem = ""
        for _ in range(TAKE_TRIES):
            try:
                warm = await pool.take()
            except OSError:
                if self._pools.get(key) is pool:
                    raise
                return await cold()  # its last job released the pool meanwhile
            try:
                problem = await asyncio.to_thread(_copy_in, config, warm.container_id, archive)
                if not problem:
                    if warm.route is not None:
                        warm.route.bind(endpoint_address)
                        await warm.route.start()
                    return DockerSession(config, warm.container_id, warm.route, warm=True)
            except BaseException:
                await _discard(warm)
                raise
            log.warning("a warm session container could not take its files", problem=problem)
            await _discard(warm)
        raise RuntimeError(f"no warm session container took the session's files: {problem}")

    async def _start(self, config: DockerSessionConfig, limits: ResourceLimits, routed: bool) -> _Warm:
        route = EndpointRoute("", config.work_root) if routed else None
        folder = route.folder if route else None
        try:  # work=None: /work stays empty, the session's files come at take
            container_id = await asyncio.to_thread(
                start_session_container, config, limits, route=folder, work=None, labels={WARM_LABEL: "1"}
            )
        except BaseException:
            if route is not None:
                await route.close()
            raise
        return _Warm(container_id, config.client, route)


async def prepare_job(backend, job_id: str, size: int, limits: ResourceLimits, *, packages=(), routed=False, images=()):
    """A job's start on a DockerBackend: `images` pulled when missing (image_cache.py), the sessions' image
    resolved (built from `packages` once), and `size` session containers of the job's key started ahead."""
    if images:
        await asyncio.to_thread(backend.images.pull_missing, list(images))
    image = await backend.packages_image(list(packages)) if packages else backend.sessions.image
    config = dataclasses.replace(backend.sessions, image=image)
    return await backend.warm.prepare(job_id, config, limits, routed, size)


async def _discard(warm: _Warm) -> None:
    await asyncio.to_thread(remove_container, warm.client, warm.container_id)
    if warm.route is not None:
        await warm.route.close()


def _stage_archive(config: DockerSessionConfig, checked, seed_dir: str | None) -> bytes:
    """The session's work folder (seed copy, then files) as a tar, staged on the host as a cold open stages it."""
    stage = stage_session_files(config, checked, seed_dir)
    try:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(stage, arcname=".")
        return buffer.getvalue()
    finally:
        remove_tree(stage)


def _copy_in(config: DockerSessionConfig, container_id: str, archive: bytes | None) -> str:
    """Unpack `archive` into the container's /work as the session's user; "" when done (None: when the
    container runs), else why not."""
    import docker.errors

    try:
        if archive is None:
            running = config.client.api.inspect_container(container_id)["State"]["Running"]
            return "" if running else "the container is not running"
        copied = DockerSession(config, container_id).exec_raw(["tar", "-x", "-f", "-"], archive, COPY_LIMITS)
    except (docker.errors.DockerException, OSError) as exc:
        return f"the container is gone: {exc}"  # an exec into a stopped container is refused
    if copied.code != 0:
        return f"tar -x exited {copied.code}: {bytes(copied.err.data)[-300:]!r}"
    return ""
