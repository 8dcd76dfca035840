"""The docker backend: each run is one fresh container from a prebuilt image, most often started ahead.

    request --> a warm container of the run's key (docker_warm_runs.py: made as below, attached and
                started ahead, its launcher waiting on stdin; the run's argv goes first on stdin and the
                launcher execs it), or none: a container made for the run
            --> host work folder (mkdtemp; a warm container's own) <-- seed_dir copy, then files; chowned
            --> container: image (default SANDBOX_IMAGE), /work a tmpfs of max_disk_mb (the host
                  folder arrives as a tar on stdin), /work/.dockyard-report a bind of one host file,
                  tmpfs /tmp,
                  network none, read-only root, cap_drop ALL, no-new-privileges, user 1000 (never root),
                  pids / memory (= swap) / CPU-quota limits, ulimits cpu, fsize, core = 0,
                  log driver none, label dockyard.sandbox.owner = host/pid/start-time
            --> attach (before start) streams stdout / stderr: the first max_output_bytes of each
                  are kept, the rest drained and dropped
            --> the wrapping shell's end line on both streams (exit code, /work full): the run is over;
                  its stdin is ended (the shell waits for that before it exits, so none of its output is
                  in flight when the engine closes the streams), its container's teardown not waited for;
                  or wall-clock limit: the container is killed
            --> Outcome; the work folder removed, then (after the verdict, the call's slot still held)
                  the container, whatever happened

Guarantees: the code cannot reach any network (no interface but loopback), cannot
write anywhere but /work (its own copy, at most `max_disk_mb` in total) and a
size-capped /tmp; on the host's disk it can write only the report file (at most
RLIMIT_FSIZE); a run that leaves /work full is FAILED, saying so; it runs without any
capability and cannot gain privileges (setuid binaries do nothing), cannot start
more than `pids_limit` tasks, use more than `memory_mb` of RAM (the kernel's OOM
killer ends it), more than `cpus` cores, or live past its wall-clock limit; when
its main process ends every process of the container ends with it. Every blocking
docker call runs in a worker thread, never on the event loop. On start the
backend removes containers that a dead predecessor on this host left behind.

Verdict rule, as in local.py (both use verdicts.py): ERROR only when the infrastructure failed (the
work folder, the engine, a missing image, the harness never started); whatever
the code does to itself is FAILED (an OOM kill included, reported as exit code
-9); the wall-clock kill is TIMEOUT.

RunTests keeps the local backend's report protection: the nonce and the payload
reach the harness through a file in /work that is opened and unlinked before
Python starts; the harness writes "<nonce> ready" as the first bytes of stderr
(before any untrusted code runs) and "<nonce> result ..." to a report file it
opened first. A program that deletes or rewrites the report file without the
nonce gets FAILED, never a pass or an ERROR. The same limit as local.py applies:
code that introspects the harness's own memory could recover the nonce.

The container's host config, its shell wrapper and the tar that carries the
work folder live in docker_container.py; the staging shared with local.py in
staging.py; sessions (one long-lived container each, same host config) in
docker_sessions.py (warm ones: docker_warm.py; images: image_cache.py), whose containers this reaper
leaves to reap_sessions.

Not covered: the report file must be a path the docker engine sees at the same
place (a service that runs in a container needs `work_root` bind-mounted at the
same path).

Why over 400 lines: the container plumbing lives in docker_container.py, the file staging in
staging.py, the sessions' own steps in docker_sessions.py and the warm run containers' in
docker_warm_runs.py; what is left is one backend's run (cold or warm), report and cleanup (which a
session's container shares), and they read as one sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog

from dockyard.rpc.errors import InvalidArgument
from services.sandbox.backend import (
    Outcome,
    ResourceLimits,
    SandboxBackend,
)
from services.sandbox.docker_container import (
    INPUT_NAME,
    LABEL,
    REPORT_NAME,
    RUN_TESTS_COMMAND,
    SESSION_LABEL,
    STAGE_COMMAND,
    EndLine,
    create_container,
    end_stdin,
    folder_bytes,
    owner_is_dead,
    owner_label,
    read_report,
    run_header,
    send_work_folder,
)
from services.sandbox.docker_sessions import DockerSessionConfig
from services.sandbox.docker_warm import WarmSessions, prepare_job
from services.sandbox.docker_warm_runs import (
    Launched,
    RunKey,
    WarmRun,
    WarmRuns,
    discard_run,
    launch_header,
    start_run_container,
)
from services.sandbox.harness import HARNESS_SOURCE
from services.sandbox.image_cache import ImageCache
from services.sandbox.staging import Capped, Writes, checked_files, parse_report, remove_tree, stage_files
from services.sandbox.verdicts import command_verdict, tests_verdict
from services.sandbox.work_folders import WorkFolders

log = structlog.get_logger()


@dataclass
class _Run:
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    exit_code: int = 0
    timed_out: bool = False
    duration: float = 0.0
    error: str = ""  # an infrastructure failure
    report: bytes = b""  # RunTests: the harness's report file
    container_id: str | None = None
    cancelled: bool = False  # the caller gave up: do not start, or kill now
    disk_full: bool = False  # /work was full when the command ended
    warm_gone: bool = False  # its warm container had died while waiting: nothing ran, the run goes cold


class DockerBackend(SandboxBackend):
    def __init__(
        self,
        *,
        image: str,
        max_concurrency: int,
        cpus: float = 1.0,
        pids_limit: int = 256,
        max_file_mb: int = 64,
        max_disk_mb: int = 256,
        tmp_mb: int = 64,
        user: str = "1000:1000",
        work_root: str | None = None,
        warm_max: int = 0,
        warm_runs: int = 0,
        image_cache_gb: float = 0.0,
        client=None,
    ) -> None:
        import docker

        # Each running container holds one connection (its attach stream) and makes a few calls.
        self._client = client or docker.from_env(timeout=120, max_pool_size=2 * max_concurrency + 4)
        self._image = image
        self._max_disk_mb = max_disk_mb
        self._uid, self._gid = (int(part) for part in user.split(":"))
        self._folders = WorkFolders(work_root)
        self._slots = asyncio.Semaphore(max_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency + 1, thread_name_prefix="sandbox-docker")
        self._owner = owner_label()
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        # What every container of the backend shares (its host config), and sessions their image too.
        mb = 1024 * 1024
        limits = (cpus, pids_limit, max_file_mb * mb, max_disk_mb, tmp_mb, work_root)
        self.sessions = DockerSessionConfig(self._client, image, self._container_user(), self._owner, *limits)
        self.warm = WarmSessions(warm_max)  # session containers started ahead (docker_warm.py)
        # Run containers started ahead, `warm_runs` per key (docker_warm_runs.py).
        self.runs = WarmRuns(warm_runs, self._start_warm_run, lambda warm: discard_run(self._client, warm))
        self.images = ImageCache(self._client, image_cache_gb, work_root, keep={image})  # (image_cache.py)

    @classmethod
    async def open(cls, **kwargs) -> DockerBackend:
        """A backend whose engine answers and whose default image exists; predecessors' leftovers reaped."""
        backend = cls(**kwargs)
        await backend.start()
        return backend

    async def start(self) -> None:
        """Check that the engine answers and the default image exists; reap predecessors' leftovers."""
        await self._call(self._check_ready)
        reaped = await self._call(self.reap)
        if reaped:
            log.info("reaped containers of a dead sandbox service", count=reaped)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _run_in_slot(self, writes, command, limits: ResourceLimits, seed_dir, image: str, nonce) -> _Run:
        """One run on a worker thread, in a warm container of its key when one is there, holding a
        concurrency slot until its container is gone; the verdict does not wait for that removal."""
        await self._slots.acquire()
        runs: list[_Run] = []
        key = RunKey(image, limits.memory_mb, limits.cpu_seconds)
        try:
            warm = await self.runs.take(key)
            run = await self._run_once(runs, warm, writes, command, limits, seed_dir, image, nonce)
            if run.warm_gone:  # nothing ran: the same run in a container made for it
                run = await self._run_once(runs, None, writes, command, limits, seed_dir, image, nonce)
        finally:
            self.runs.refill(key)
            ended = [r.container_id for r in runs if r.container_id is not None]
            removing = asyncio.get_running_loop().run_in_executor(self._pool, self._remove_runs, ended)
            removing.add_done_callback(lambda _: self._slots.release())
        return run

    async def _run_once(self, runs: list[_Run], warm: WarmRun | None, *args) -> _Run:
        run = _Run()
        runs.append(run)
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._run, run, warm, *args)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller gave up (deadline, shutdown): end the container now, not at its timeout.
            run.cancelled = True
            if run.container_id is not None:
                await asyncio.to_thread(self._kill_quietly, run.container_id)
            await asyncio.wait([future])
            raise
        return run

    def _check_ready(self) -> None:
        import docker.errors

        self._client.ping()
        try:
            self._client.images.get(self._image)
        except docker.errors.ImageNotFound:
            raise RuntimeError(
                f"sandbox image {self._image!r} not found: build it with deploy/images/build.sh"
            ) from None

    def reap(self) -> int:
        """Remove labelled containers whose owning service (on this host) is gone; returns how many."""
        count = 0
        # sparse: the listing's own labels, no inspect per container, so a container another
        # service removes meanwhile cannot fail the listing (NotFound) and the start with it.
        for container in self._client.containers.list(all=True, sparse=True, filters={"label": LABEL}):
            labels = container.attrs.get("Labels") or {}
            label = labels.get(LABEL, "")
            if SESSION_LABEL in labels:
                continue  # a session's: reap_sessions removes and counts those
            if label != self._owner and owner_is_dead(label):
                try:
                    container.remove(force=True)
                    count += 1
                except Exception as exc:  # already gone, or being removed
                    log.warning("could not reap container", id=container.id[:12], error=str(exc))
        return count

    async def execute(
        self,
        files: Mapping[str, str],
        command: Sequence[str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
    ) -> Outcome:
        if not command or not command[0]:
            raise InvalidArgument("command: must name the program to run")
        checked = checked_files(files)
        writes = [(str(path), content) for path, content in checked]
        run = await self._run_in_slot(writes, list(command), limits, seed_dir, image or self._image, None)
        return command_verdict(run)

    async def run_tests(self, program: str, tests: Sequence[str], limits: ResourceLimits) -> Outcome:
        if not tests:
            raise InvalidArgument("tests: at least one test is required (no tests would pass vacuously)")
        nonce = secrets.token_hex(16).encode()
        payload = nonce + b"\n" + json.dumps({"program": program, "tests": list(tests)}).encode()
        total = len(tests)
        command = ["sh", "-c", RUN_TESTS_COMMAND, HARNESS_SOURCE]
        run = await self._run_in_slot([(INPUT_NAME, payload)], command, limits, None, self._image, nonce)
        ready = nonce + b" ready\n"
        started = run.stderr.startswith(ready)
        run.stderr = run.stderr.removeprefix(ready)  # on every path: the nonce is not the code's output
        # started from stderr, not from the report file: the code can delete or rewrite that file, and
        # what it does to itself must be FAILED (no valid report), never the ERROR of "did not start".
        _, results = parse_report(run.report, nonce, total)
        return tests_verdict(run, total=total, started=started, results=results)

    async def open_session(
        self,
        files: Mapping[str, str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
        endpoint_address: str = "",
    ):
        config = dataclasses.replace(self.sessions, image=image or self._image)
        return await self.warm.open(config, files, limits, seed_dir=seed_dir, endpoint_address=endpoint_address)

    async def prepare_sessions(self, job_id: str, size: int, limits: ResourceLimits, **job) -> int:
        return await prepare_job(self, job_id, size, limits, **job)

    async def release_sessions(self, job_id: str) -> None:
        await self.warm.release(job_id)

    async def packages_image(self, requirements: Sequence[str]) -> str:
        from services.sandbox.images import ensure_env_image

        # Content-addressed: built once per requirement set from the wheelhouse (--network none), then reused.
        built: list[str] = []
        tag = await asyncio.to_thread(
            ensure_env_image, self._client, self._image, list(requirements), on_build=built.append
        )
        if built:  # built by this service: the cache's, kept in bounds
            await asyncio.to_thread(self.images.added, tag)
        else:  # a use (of a cached image; one made elsewhere is not the cache's and stays untouched)
            await asyncio.to_thread(self.images.touch, tag)
        return tag

    def reap_sessions(self) -> int:
        from services.sandbox.docker_sessions import reap_session_containers

        return reap_session_containers(self._client, self._owner)

    async def close(self) -> None:
        """Remove the warm containers and those still running (their calls end as errors or timeouts)."""
        await self.warm.close()
        await self.runs.close()

        def remove_live() -> None:
            with self._live_lock:
                live = list(self._live)
            for container_id in live:
                try:
                    self._client.api.remove_container(container_id, force=True)
                except Exception:
                    pass  # gone already

        await asyncio.to_thread(remove_live)
        await asyncio.to_thread(self._folders.close)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the blocking part, run in a worker thread -------------------------------------------------

    def _prepare(self, writes: Writes, seed_dir: str | None, work: str | None = None) -> str:
        """The run's host folder (`work`: a warm container's, its report file in it already), files staged."""
        work = work or self._folders.make()
        stage_files(work, writes, seed_dir)
        Path(work, REPORT_NAME).touch()  # bind-mounted into /work: the run's one file on the host's disk
        if os.geteuid() == 0:
            for root, dirs, names in os.walk(work):
                for entry in (root, *(os.path.join(root, n) for n in dirs + names)):
                    os.lchown(entry, self._uid, self._gid)
        return work

    def _container_user(self) -> str:
        # As root the work folder is chowned to the sandbox user; otherwise the container runs as
        # the service's own (non-root) user, who owns the work folder.
        return f"{self._uid}:{self._gid}" if os.geteuid() == 0 else f"{os.getuid()}:{os.getgid()}"

    def _start_warm_run(self, key: RunKey) -> WarmRun:
        """A run container of `key` started ahead, with its own host folder (the report file); blocks."""
        work = self._prepare([], None)
        try:
            return start_run_container(self.sessions, work, key)
        except BaseException:
            remove_tree(work)
            raise

    def _run(
        self,
        run: _Run,
        warm: WarmRun | None,
        writes: Writes,
        command: list[str],
        limits: ResourceLimits,
        seed_dir: str | None,
        image: str,
        nonce: bytes | None,
    ) -> _Run:
        try:
            work = self._prepare(writes, seed_dir, warm.work if warm else None)
        except OSError as exc:
            if warm is not None:
                discard_run(self._client, warm)
            run.error = f"cannot prepare the work folder: {exc}"
            return run
        try:
            staged = folder_bytes(work)
            if staged > self._max_disk_mb * 1024 * 1024:
                if warm is not None:
                    discard_run(self._client, warm)
                run.error = f"the work folder's files ({staged} bytes) exceed DOCKYARD_SANDBOX_MAX_DISK_MB"
                return run
            argv = ["sh", "-c", STAGE_COMMAND, "sh", *command]
            self._run_container(run, warm, work, argv, limits, image, nonce)
            if nonce is not None and not run.error:
                run.report = read_report(os.path.join(work, REPORT_NAME))
        finally:
            remove_tree(work)
        return run

    def _run_container(
        self,
        run: _Run,
        warm: WarmRun | None,
        work: str,
        command: list[str],
        limits: ResourceLimits,
        image: str,
        nonce: bytes | None,
    ) -> None:
        """`command` in a container made now, or in `warm` (started ahead: its launcher execs `command`)."""
        import docker.errors

        api = self._client.api
        container_id = warm.container_id if warm else None
        launched = Launched() if warm else None  # a warm launcher's GO comes first on stdout
        start = time.monotonic()
        try:
            try:
                if warm is None:
                    config = self.sessions.host(work=work, limits=limits)
                    container_id = create_container(
                        api, image, command, user=self._container_user(), owner=self._owner, config=config
                    )
                with self._live_lock:
                    self._live.add(container_id)
                run.container_id = container_id
                if run.cancelled:
                    run.error = "the call was cancelled before the container started"
                    return
                if warm is None:
                    # Attach before start: nothing the code prints is missed, and nothing goes to a log file.
                    stream = api.attach(container_id, stdout=True, stderr=True, stream=True, logs=False, demux=True)
                    stdin = api.attach_socket(container_id, params={"stdin": 1, "stream": 1})
                    api.start(container_id)
                else:
                    stream, stdin = warm.stream, warm.stdin
                token = secrets.token_hex(16).encode()  # STAGE_COMMAND's end line, on each stream
                header, files = run_header(token, work)
                header = (launch_header(command) if warm else b"") + header
                send_work_folder(stdin, work, header, tar=files, keep_open=True)
            except (docker.errors.DockerException, OSError) as exc:
                run.error = f"cannot start the container: {exc}"
                run.warm_gone = warm is not None
                return
            killer = threading.Timer(limits.timeout_seconds, self._kill, (run, container_id))
            killer.daemon = True
            killer.start()
            # The ready line is not the code's output: room for it on top of the cap.
            out = Capped(limits.max_output_bytes)
            err = Capped(limits.max_output_bytes + (len(nonce) + 7 if nonce is not None else 0))
            ends = EndLine(token), EndLine(token)
            try:
                for chunk_out, chunk_err in stream:
                    if chunk_out and launched is not None:
                        chunk_out = launched.code_output(chunk_out)
                    if chunk_out:
                        out.add(ends[0].code_output(chunk_out))
                    if chunk_err:
                        err.add(ends[1].code_output(chunk_err))
                    if ends[0].end and ends[1].end:
                        # The command ended and all its output came: its shell may exit now (STAGE_COMMAND);
                        # the engine's teardown of the container is not waited for.
                        end_stdin(stdin)
                        break
                else:  # killed (wall clock, cancelled) before the end line: the engine says how it ended
                    out.add(ends[0].rest())
                    err.add(ends[1].rest())
                self._exit_state(run, ends[0].end if ends[1].end else None, container_id, limits)
            except Exception as exc:  # the engine went away mid-run
                if not run.timed_out:
                    run.error = f"lost the container: {type(exc).__name__}: {exc}"
            finally:
                killer.cancel()
                end_stdin(stdin)
                stream.close()
            if launched is not None and not launched.ok and not run.timed_out and not run.cancelled:
                run.error, run.warm_gone = "the warm container was gone before its command started", True
            if run.timed_out:
                run.exit_code = -9
            run.stdout, run.stderr = bytes(out.data), bytes(err.data)
            run.truncated = out.truncated or err.truncated
        finally:
            run.duration = time.monotonic() - start
            if warm is not None:  # its attach connections, when an early return left them open
                for closable in (warm.stdin, warm.stream):
                    with contextlib.suppress(Exception):
                        closable.close()

    def _exit_state(self, run: _Run, end: tuple[int, bool] | None, container_id: str, limits) -> None:
        """The run's exit code and full /work, from its end line or, without one, from the engine."""
        api = self._client.api
        if end is None:
            run.exit_code = api.wait(container_id, timeout=max(limits.timeout_seconds, 30) + 30).get("StatusCode", -1)
        else:
            run.exit_code, run.disk_full = end
        if run.exit_code == 137 and not run.timed_out:
            if end is not None:  # the container is told to have been killed for memory once it stopped
                api.wait(container_id, timeout=30)
            if api.inspect_container(container_id)["State"].get("OOMKilled"):
                run.exit_code = -9  # killed by the kernel for using too much memory

    def _remove_runs(self, container_ids: list[str]) -> None:
        """Remove ended runs' containers (a killed one's included)."""
        import docker.errors

        for container_id in container_ids:
            try:
                self._client.api.remove_container(container_id, force=True)
            except docker.errors.NotFound:
                pass
            except Exception as exc:
                log.warning("container not removed; the next start reaps it", id=container_id[:12], error=str(exc))
            with self._live_lock:
                self._live.discard(container_id)

    def _kill(self, run: _Run, container_id: str) -> None:
        run.timed_out = True
        self._kill_quietly(container_id)

    def _kill_quietly(self, container_id: str) -> None:
        try:
            self._client.api.kill(container_id)
        except Exception:
            pass  # it just ended on its own
