"""Warm run containers: Execute and RunTests take a container created and started ahead, not one made for the call.

    a key's second run --> WarmRuns: a pool for key = (image, memory_mb, cpu_seconds), `size` containers
        started_run: a host work folder holding only the report file (bind-mounted, as a cold run's),
            the container made by the same create_container / host_config as a cold run's, label warm-run,
            attached (stdin, stdout / stderr) before start; PID 1 is LAUNCHER_SOURCE, which says READY
            and waits on stdin; READY read, nothing else run
    a run of that key --> take(): a waiting container (the pool starts a replacement meanwhile), or None
            (no pool yet: the key's first run, an image that cannot start one, the pool is closed): a cold run
        the call's files staged in its work folder --> stdin: launch_header(argv), then the end token's line
            and the tar as a cold run sends them --> the launcher reads the header, says GO on stdout, restores
            the signal dispositions Python changed and execs argv: `sh -c STAGE_COMMAND sh CMD...`, the same
            PID 1 a cold run's container starts with, reading the same token and tar from the same stdin
        --> output, end line, exit, wall-clock kill, OOM check and removal exactly as a cold run's (docker_backend.py)

Guarantees: a warm container has the host config, user, limits, mounts and labels (plus the warm-run label)
of the cold container its run would have had, because the run's key holds everything of them that a
request can change (image, memory, CPU seconds) and the rest is the backend's; its PID 1 becomes the
cold run's command (same argv, environment, working folder, open files, signal dispositions; only its CPU
time so far, the launcher's start, counts against the same RLIMIT_CPU). A warm container serves one run
and is removed with it, never given back. Until the launcher has read its command, nothing of a call ran
in it; the launcher's GO is the first output and is not the code's (it is cut off the run's stdout), and a
run that never saw it (the container died while waiting) is retried cold, never scored. Per-call limits
that a container does not fix (the wall-clock limit, the output cap) apply from take() on, as for a cold
run from its start. A key gets a pool only on its second run, so an image used once (a SWE instance's)
starts no container that never serves; a key whose container would not start (an image without python3)
runs cold for REFUSED_SECONDS before it is tried again; at most MAX_KEYS pools, the least recently used closed beyond
that, and every pool closed (its waiting containers and their folders removed) by close().

Not covered: a waiting container holds its launcher (a Python process, a few MB) and two engine connections.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from services.sandbox.backend import ResourceLimits
from services.sandbox.docker_container import create_container, remove_container
from services.sandbox.staging import remove_tree
from services.sandbox.warm_pool import WarmPool

log = structlog.get_logger()

WARM_RUN_LABEL = "dockyard.sandbox.warm-run"  # on a run container started ahead of its call
READY = b"dockyard-run-ready\n"
GO = b"dockyard-run-go\n"  # the launcher read its command: the first bytes of stdout, never the code's
MAX_KEYS = 4  # pools kept at once (keys beyond: the least recently used pool is closed)
SEEN_KEYS = 256  # keys remembered for the second-run rule
REFUSED_SECONDS = 300.0  # a key whose container would not start runs cold this long before a new try
HEADER_DIGITS = 10

# PID 1 of a waiting container: READY, then read the command (a length, then JSON argv) from stdin, GO,
# and exec it with the signal dispositions of a process the engine started (Python ignores SIGPIPE and
# SIGXFSZ; an exec keeps what is ignored). The rest of stdin (the end token's line, the work folder's tar) is the
# command's.
LAUNCHER_SOURCE = rf"""
import json, os, signal
os.write(1, {READY!r})
def exact(n):
    data = b""
    while len(data) < n:
        part = os.read(0, n - len(data))
        if not part:
            os._exit(0)
        data += part
    return data
argv = json.loads(exact(int(exact({HEADER_DIGITS}))))
for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
os.write(1, {GO!r})
os.execvp(argv[0], argv)
"""
LAUNCHER_COMMAND = ["python3", "-I", "-S", "-c", LAUNCHER_SOURCE]


def launch_header(argv: list[str]) -> bytes:
    """What a waiting container's launcher reads before the tar: the length of the argv's JSON, then it."""
    payload = json.dumps(argv).encode()
    return b"%0*d" % (HEADER_DIGITS, len(payload)) + payload


@dataclass(frozen=True)
class RunKey:
    """Everything of a run's container that a request can change."""

    image: str
    memory_mb: int
    cpu_seconds: float


@dataclass
class WarmRun:
    container_id: str
    work: str  # the host folder whose report file is bind-mounted; the call's files are staged here
    stream: Iterator  # the attach stream of (stdout, stderr) chunks, READY read
    stdin: socket.socket  # the attach socket of the container's stdin


class Launched:
    """A warm run's stdout: GO cut off its start; `ok` once it came (the command was launched)."""

    def __init__(self) -> None:
        self.head = b""
        self.ok: bool | None = None  # None: not decided yet

    def code_output(self, chunk: bytes) -> bytes:
        if self.ok is not None:
            return chunk
        self.head += chunk
        if len(self.head) < len(GO) and GO.startswith(self.head):
            return b""
        self.ok = self.head.startswith(GO)
        return self.head[len(GO) :] if self.ok else self.head


def read_ready(stream: Iterator) -> None:
    """Read a starting container's attach stream until the launcher's READY (the stream stays open)."""
    said = b""
    for chunk_out, chunk_err in stream:
        said = (said + (chunk_out or b"") + (chunk_err or b""))[-4096:]
        if READY in said:
            return
    raise RuntimeError(f"the warm run container did not start: {said[-500:]!r}")


class WarmRuns:
    """Pools of warm run containers per RunKey; `start` and `discard` block (run in worker threads)."""

    def __init__(self, size: int, start: Callable[[RunKey], WarmRun], discard: Callable[[WarmRun], None]) -> None:
        self._size = size
        self._start_blocking, self._discard_blocking = start, discard
        self._pools: OrderedDict[RunKey, WarmPool[WarmRun]] = OrderedDict()
        self._seen: OrderedDict[RunKey, None] = OrderedDict()
        self._refused: dict[RunKey, float] = {}  # keys whose container would not start: cold until then
        self._closed = False

    def waiting(self) -> int:
        return sum(pool.waiting() for pool in self._pools.values())

    async def take(self, key: RunKey) -> WarmRun | None:
        """A started container of `key` for one run, or None: run cold."""
        if self._size == 0 or self._closed or self._refused.get(key, 0.0) > time.monotonic():
            return None
        pool = self._pools.get(key)
        if pool is None:
            if key not in self._seen:  # the key's first run: cold, remembered
                self._seen[key] = None
                while len(self._seen) > SEEN_KEYS:
                    self._seen.popitem(last=False)
                return None
            pool = WarmPool(lambda: self._start(key), self._discard, lambda _: True, self._size)
            self._pools[key] = pool
            while len(self._pools) > MAX_KEYS:
                _, oldest = self._pools.popitem(last=False)
                await oldest.close()
        self._pools.move_to_end(key)
        try:
            return await pool.take(top_up=False)
        except OSError:  # the pool closed meanwhile (the service stops)
            return None
        except Exception as exc:  # noqa: BLE001 -- a warm start is an optimisation; the run goes cold
            log.warning("no warm run container; this key's runs start their own", image=key.image, error=str(exc))
            self._refused[key] = time.monotonic() + REFUSED_SECONDS
            if self._pools.get(key) is pool:
                del self._pools[key]
                await pool.close()
            return None

    def refill(self, key: RunKey) -> None:
        """A run of `key` ended: its pool starts its replacements now (not alongside the run, whose command
        would share the CPU with them)."""
        if (pool := self._pools.get(key)) is not None:
            pool.top_up()

    async def _start(self, key: RunKey) -> WarmRun:
        starting = asyncio.ensure_future(asyncio.to_thread(self._start_blocking, key))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:  # the caller gave up: the container it would have had is removed
            await asyncio.wait([starting])
            if not starting.cancelled() and starting.exception() is None:
                await self._discard(starting.result())
            raise

    async def _discard(self, warm: WarmRun) -> None:
        await asyncio.to_thread(self._discard_blocking, warm)

    async def close(self) -> None:
        self._closed = True
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            await pool.close()


def start_run_container(config, work: str, key: RunKey) -> WarmRun:
    """A run container of `key` (`config`: the backend's DockerSessionConfig) created as a cold run's, with
    `work`'s report file bind-mounted, attached and started; returned once its launcher said READY. Blocks."""
    api = config.client.api
    limits = ResourceLimits(1.0, memory_mb=key.memory_mb, cpu_seconds=key.cpu_seconds, max_output_bytes=1)
    host = config.host(work=work, limits=limits)
    labels = {WARM_RUN_LABEL: "1"}
    container_id = create_container(
        api, key.image, LAUNCHER_COMMAND, user=config.user, owner=config.owner, config=host, labels=labels
    )
    try:
        stream = api.attach(container_id, stdout=True, stderr=True, stream=True, logs=False, demux=True)
        stdin = api.attach_socket(container_id, params={"stdin": 1, "stream": 1})
        api.start(container_id)
        read_ready(stream)
    except BaseException:
        remove_container(config.client, container_id)
        raise
    return WarmRun(container_id, work, stream, stdin)


def discard_run(client, warm: WarmRun) -> None:
    """A waiting container that will serve no run: its connections closed, the container and folder removed."""
    for closable in (warm.stdin, warm.stream):
        try:
            closable.close()
        except Exception:  # noqa: BLE001 -- closed already
            pass
    remove_container(client, warm.container_id)
    remove_tree(warm.work)
