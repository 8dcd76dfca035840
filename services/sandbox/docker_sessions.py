"""Docker-backend sessions: one long-lived locked-down container per session, `docker exec` per command.

    open   --> host stage folder <-- seed_dir copy, then files (removed once sent)
           --> container (docker_session_start.py, which starts a warm one's too, docker_warm.py):
                 the host config of a run (docker_container.host_config, without the report
                 bind: no host path at all), labels owner + dockyard.sandbox.session
           --> the stage arrives as a tar on stdin into the /work tmpfs (max_disk_mb); then PID 1 is a
                 reaper (REAPER_SOURCE) that only waits for orphans, so nothing piles up as zombies
                 (with an endpoint_address: also the container end of the session's one route,
                 endpoint_route.py, its socket's folder the only host path mounted, read-only)
    exec   --> docker exec (the container's user, cwd /work) of COMMAND_WRAPPER: stdin's first line is the
                 exec's end token and the byte count of the command's stdin; the command, then
                 `kill -9 -1`, which ends every process but PID 1, then `stat -f` flags a full /work; the
                 end line `<token> <exit code> <full>` on stdout and stderr; the exec then waits for
                 stdin's end, which the host sends once both end lines came (past the wall-clock limit:
                 the same kill from a second exec)
    read / write_file --> session_files' source run by python3 in the container (links never followed)
    export_tree --> `tar -c` of /work (without .git), extracted on the host under tarfile's "tar" filter
    close  --> the container removed (force); start: reap_session_containers removes those of a dead
               owner (same rule as docker_backend's reaper)

Guarantees: everything docker_backend.py guarantees of a run's container holds for the whole
session (no network, read-only root, no capabilities, non-root user, pids / memory / CPU-quota
limits across all its commands, RLIMIT_CPU / FSIZE per process, /work at most max_disk_mb); what
a command leaves in /work (a timed-out one included) is what the next finds; no process of a
command outlives it, nor its caller's giving up (a cancelled call kills it before it returns);
every docker call blocks a worker thread, never the event loop. An exec's output is whole: the engine
gives an exited exec's output copies 2 s before it closes them (moby's daemon/monitor.go), so under load a
short command's output could be lost while its exit code was kept; an exec here does not exit before the
host has both its end lines, so there is nothing left in flight to lose.

Not covered: the memory limit is the whole container's (all commands, and /work's tmpfs, count);
a command killed by the kernel for memory reads as exit code 137, not -9.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tarfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.sandbox import session_files
from services.sandbox.backend import DISK_FULL_MESSAGE, Outcome, ResourceLimits, SessionHandle, Status, run_outcome
from services.sandbox.docker_container import (
    LABEL,
    SESSION_LABEL,
    WORK,
    EndLine,
    end_stdin,
    host_config,
    owner_is_dead,
    remove_container,
)
from services.sandbox.docker_session_start import stage_session_files, start_session_container
from services.sandbox.endpoint_route import EndpointRoute, endpoint_url
from services.sandbox.staging import Capped, checked_files, remove_tree

log = structlog.get_logger()

# Around every exec (the module docstring): read the end token and the command's stdin size (dash's read
# takes stdin byte by byte, so the command's bytes stay whole), run the command, end each stream with the
# end line, then wait for stdin's end: the host's word that both end lines came. The token is never in an
# argv or the environment, so a command that prints its processes' does not end its output early.
_RUN = 'read -r end n || exit 125; if [ "$n" = 0 ]; then "$@" </dev/null; else head -c "$n" | "$@"; fi; rc=$?; '
_END = 'echo "$end $rc $full"; echo "$end $rc $full" >&2; cat >/dev/null; exit $rc'
# A session command's: then every process but PID 1 (and this shell) ends, so none outlives its command.
COMMAND_WRAPPER = _RUN + f'kill -9 -1 2>/dev/null; full=0; [ "$(stat -f -c %a {WORK})" != 0 ] || full=1; ' + _END
HELPER_WRAPPER = _RUN + "full=0; " + _END  # the service's own execs: file helper, copy-in, disk check
KILL_ALL = ["sh", "-c", "kill -9 -1 2>/dev/null; true"]
KILLED_GRACE_SECONDS = 1.0  # how long a SIGKILLed command's container may take to show it stopped
FILES_SOURCE = Path(session_files.__file__).read_text()
EXPORT_SLACK_BYTES = 16 * 1024 * 1024  # tar headers on top of /work's files


@dataclass(frozen=True)
class ExecResult:
    """One exec's output and end: `end` is its end line's (exit code, /work full), None when the wrapper was
    killed before writing it (then `code` is the engine's, and the output is what came)."""

    out: Capped
    err: Capped
    code: int
    timed_out: bool
    end: tuple[int, bool] | None

    @property
    def disk_full(self) -> bool:
        return self.end is not None and self.end[1]


@dataclass(frozen=True)
class DockerSessionConfig:
    client: object
    image: str
    user: str
    owner: str
    cpus: float
    pids_limit: int
    max_file_bytes: int
    max_disk_mb: int
    tmp_mb: int
    work_root: str | None

    def host(self, *, work: str, limits: ResourceLimits, report: bool = True, route: str | None = None) -> dict:
        """docker_container.host_config with these settings: every container's, a run's, a session's, a warm one's."""
        return host_config(
            self.client.api,
            work=work,
            limits=limits,
            user=self.user,
            cpus=self.cpus,
            pids_limit=self.pids_limit,
            max_file_bytes=self.max_file_bytes,
            max_disk_mb=self.max_disk_mb,
            tmp_mb=self.tmp_mb,
            report=report,
            route=route,
        )


def container_running(api: Any, container_id: str, *, killed: bool) -> bool:
    """Whether the container still runs, as the engine's low-level `api` reports it. A command SIGKILLed with
    its container can end before the engine marks the container stopped, so a killed command's container
    gets a short grace to show it."""
    deadline = time.monotonic() + (KILLED_GRACE_SECONDS if killed else 0.0)
    while api.inspect_container(container_id)["State"]["Running"]:
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)
    return False


class DockerSession(SessionHandle):
    def __init__(
        self, config: DockerSessionConfig, container_id: str, route: EndpointRoute | None = None, *, warm: bool = False
    ) -> None:
        self._config = config
        self.warm = warm
        self._api = config.client.api
        self._id = container_id
        self._route = route
        self.work_dir = WORK
        self.endpoint_url = endpoint_url() if route else ""

    @property
    def container_id(self) -> str:
        """The engine's id of the session's container: what `docker inspect` / `docker logs` take when an
        operator traces a session (its labels say session, and warm when started ahead)."""
        return self._id

    async def exec(self, argv: Sequence[str], stdin: bytes | None, limits: ResourceLimits) -> Outcome:
        running = asyncio.ensure_future(asyncio.to_thread(self._exec, list(argv), stdin or b"", limits))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:  # the caller gave up: end the command now, not at its timeout
            await asyncio.to_thread(self._kill_commands, threading.Event())
            await asyncio.wait([running])
            raise

    def _exec(self, argv: list[str], stdin: bytes, limits: ResourceLimits) -> Outcome:
        import docker.errors

        start = time.monotonic()
        try:
            result = self.exec_raw(argv, stdin, limits, command=True)
            code, timed_out, disk_full = result.code, result.timed_out, result.disk_full
            if result.end is None:  # the wrapper itself was killed: the container may have been
                killed = code in (-1, 137) and not timed_out
                if code != 0 and not container_running(self._api, self._id, killed=killed):
                    raise OSError("the container stopped")  # killed under the command: not the command's failure
                disk_full = not timed_out and self._disk_full(limits)
        except (docker.errors.DockerException, OSError) as exc:
            message = f"the session's container is gone (closed, or ended for memory): {exc}"
            duration = time.monotonic() - start
            return Outcome(Status.ERROR, tests_total=1, error_message=message, duration_seconds=duration)
        if timed_out:
            status, code = Status.TIMEOUT, -9
        else:
            status = Status.PASSED if code == 0 else Status.FAILED
        if disk_full:
            status = Status.FAILED
        return run_outcome(
            status,
            passed=int(status is Status.PASSED),
            total=1,
            exit_code=code,
            stdout=bytes(result.out.data),
            stderr=bytes(result.err.data),
            truncated=result.out.truncated or result.err.truncated,
            duration=time.monotonic() - start,
            error_message=DISK_FULL_MESSAGE if disk_full else "",
        )

    def exec_raw(self, argv: list[str], stdin: bytes, limits: ResourceLimits, *, command: bool = False) -> ExecResult:
        """One docker exec of `argv` in the end-line handshake (COMMAND_WRAPPER for a session's `command`, which
        kills what the command left and checks /work; HELPER_WRAPPER otherwise)."""
        from docker.utils.socket import frames_iter

        token = secrets.token_hex(16).encode()
        wrapper = COMMAND_WRAPPER if command else HELPER_WRAPPER
        exec_id = self._api.exec_create(
            self._id,
            ["sh", "-c", wrapper, "sh", *argv],
            stdin=True,
            user=self._config.user,
            workdir=WORK,
            environment={"HOME": WORK},
        )["Id"]
        sock = self._api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        timed_out = threading.Event()
        killer = threading.Timer(limits.timeout_seconds, self._kill_commands, (timed_out,))
        killer.daemon = True
        killer.start()
        # Fed from its own thread: a command that does not read its stdin never blocks the output's reader.
        threading.Thread(target=_feed, args=(raw, token + b" %d\n" % len(stdin) + stdin), daemon=True).start()
        out, err = Capped(limits.max_output_bytes), Capped(limits.max_output_bytes)
        ends = {1: EndLine(token), 2: EndLine(token)}
        answered = False
        try:
            for stream, data in frames_iter(sock, tty=False):
                if stream in ends:
                    (out if stream == 1 else err).add(ends[stream].code_output(data))
                if not answered and ends[1].end and ends[2].end:
                    # Both end lines came: the exec may exit now, nothing of it is in flight.
                    end_stdin(raw, close=False)
                    answered = True
        finally:
            killer.cancel()
            # A kill that fired as the command ended is let finish here: run later, its `kill -9 -1` would
            # reach the session's next command (seen: a command that printed nothing and exited 137).
            killer.join()
            sock.close()
        if answered:
            return ExecResult(out, err, ends[1].end[0], timed_out.is_set(), ends[1].end)
        out.add(ends[1].rest())
        err.add(ends[2].rest())
        code = self._api.exec_inspect(exec_id).get("ExitCode")
        return ExecResult(out, err, -1 if code is None else code, timed_out.is_set(), None)

    def _disk_full(self, limits: ResourceLimits) -> bool:
        free = self.exec_raw(["stat", "-f", "-c", "%a", WORK], b"", limits).out
        return bytes(free.data).strip() == b"0"

    def _kill_commands(self, timed_out: threading.Event) -> None:
        timed_out.set()
        try:
            exec_id = self._api.exec_create(self._id, KILL_ALL, user=self._config.user)["Id"]
            self._api.exec_start(exec_id)
        except Exception:
            pass  # the container is gone: so is the command

    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        out = await self._files(["read", path, str(max_bytes)], b"", max_bytes + 32)
        size, _, data = out.partition(b"\n")
        return data, int(size)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._files(["write", path], data, 4096)

    async def _files(self, args: list[str], stdin: bytes, cap: int) -> bytes:
        limits = ResourceLimits(timeout_seconds=60, memory_mb=0, cpu_seconds=0, max_output_bytes=cap)
        argv = ["python3", "-I", "-S", "-c", FILES_SOURCE, *args]
        result = await asyncio.to_thread(self.exec_raw, argv, stdin, limits)
        if result.code == session_files.EXIT_PROBLEM:
            kind, _, message = bytes(result.err.data).decode("utf-8", "replace").strip().partition(" ")
            raise session_files.FileProblem(kind, message)
        if result.code != 0:
            raise RuntimeError(f"the session's file helper failed ({result.code}): {bytes(result.err.data)[-500:]!r}")
        return bytes(result.out.data)

    async def export_tree(self, target: str) -> str:
        await asyncio.to_thread(self._export, target)
        return os.path.join(target, "tree")

    def _export(self, target: str) -> None:
        from docker.utils.socket import frames_iter

        cap = self._config.max_disk_mb * 1024 * 1024 + EXPORT_SLACK_BYTES
        exec_id = self._api.exec_create(
            self._id, ["tar", "-c", "-f", "-", "--exclude=./.git", "."], user=self._config.user, workdir=WORK
        )["Id"]
        sock = self._api.exec_start(exec_id, socket=True)
        archive, written = os.path.join(target, ".tree.tar"), 0
        try:
            with open(archive, "wb") as file:
                for stream, data in frames_iter(sock, tty=False):
                    if stream == 1 and written < cap:
                        file.write(data)
                        written += len(data)
        finally:
            sock.close()
        tree = os.path.join(target, "tree")
        with tarfile.open(archive) as tar:
            for member in tar:
                try:  # "tar": no absolute names, nothing outside the target, no setuid bits
                    tar.extract(member, tree, filter="tar")
                except (tarfile.TarError, OSError) as exc:
                    log.warning("session file not exported", name=member.name[:200], error=str(exc))
        os.unlink(archive)

    def kill(self) -> None:
        threading.Thread(target=self._remove, daemon=True).start()

    def _remove(self) -> None:
        remove_container(self._config.client, self._id)

    async def close(self) -> None:
        await asyncio.to_thread(self._remove)
        if self._route is not None:
            await self._route.close()


def _feed(raw, data: bytes) -> None:
    try:
        raw.sendall(data)
    except OSError:
        pass  # the exec ended (killed) without reading it all


async def open_docker_session(
    config: DockerSessionConfig,
    files: Mapping[str, str],
    limits: ResourceLimits,
    *,
    seed_dir: str | None,
    endpoint_address: str = "",
) -> DockerSession:
    """A session's container; with `endpoint_address`, its one route is to that address (endpoint_route.py)."""
    checked = checked_files(files)
    route = None
    if endpoint_address:
        route = EndpointRoute(endpoint_address, config.work_root)
        await route.start()
    try:
        return await asyncio.to_thread(_open, config, checked, limits, seed_dir, route)
    except BaseException:
        if route is not None:
            await route.close()
        raise


def _open(
    config: DockerSessionConfig, checked, limits: ResourceLimits, seed_dir: str | None, route: EndpointRoute | None
) -> DockerSession:
    stage = stage_session_files(config, checked, seed_dir)
    try:
        container_id = start_session_container(config, limits, route=route.folder if route else None, work=stage)
        return DockerSession(config, container_id, route)
    finally:
        remove_tree(stage)


def reap_session_containers(client, owner: str) -> int:
    """Remove session containers whose owning service (on this host) is gone; returns how many."""
    count = 0
    for container in client.containers.list(all=True, sparse=True, filters={"label": SESSION_LABEL}):
        label = (container.attrs.get("Labels") or {}).get(LABEL, "")
        if label != owner and owner_is_dead(label):
            try:
                container.remove(force=True)
                count += 1
            except Exception as exc:  # already gone, or being removed
                log.warning("could not reap a session container", id=container.id[:12], error=str(exc))
    return count
