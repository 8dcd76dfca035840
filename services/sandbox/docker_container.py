"""The container of one docker-backend run: its limits, its owner label, and what crosses into and out of it.

    limits --host_config--> network none, read-only root, cap_drop ALL, no-new-privileges,
                            pids / memory (= swap) / CPU-quota limits, ulimits cpu, fsize, core = 0,
                            /work a tmpfs of max_disk_mb, tmpfs /tmp, /work/REPORT_NAME a bind of one
                            host file, log driver none
           --create_container--> created, not started; user, label dockyard.sandbox.owner = owner_label()
    command --STAGE_COMMAND--> sh: read the run's end token (one line of stdin), untar the rest of stdin
            into /work (a call without files sends none), run, then write the end line
            `<token> <exit code> <1 if /work is full>` on stdout and on stderr, then wait for stdin's end
            (RunTests: RUN_TESTS_COMMAND opens and unlinks the input, then execs the harness)
            --EndLine--> the code's output of each stream, and the end line cut off it
    host work folder --send_work_folder--> a header, then a tar on the container's stdin (the report file
            left out); stdin stays open (`keep_open`) until end_stdin: once both end lines came, or the run
            was killed
    host report file --read_report--> at most REPORT_CAP_BYTES, never through a link
    owner_is_dead(label) --> the reaper removes a dead predecessor's containers
    remove_container --> force-removed; a failure (gone already, the engine away) is left to the reaper

Guarantees: every container gets the same locked-down host config, whatever the
command; the only host path it sees is the report file; reading the report never
follows a link the code planted and never blocks on a fifo; a label names a dead
owner only for this host and only when that process (pid and start time) is gone,
so a reused pid never passes for its predecessor. The end line comes after everything the command
wrote to that stream before it ended, so once both streams brought it the run's output and exit code are
known without waiting for the engine's teardown of the container (which the run's removal then ends). The
command's shell does not exit before the host ends its stdin: the engine gives an exited container's output
copies 2 s before it closes them (moby's daemon/monitor.go), so under load output still in flight, the end
line included, could be lost while the exit code was kept; a process that has not exited loses nothing. The
line is only ever a claim about the code's own run: code that found the token (in the shell's memory) and
printed the line itself would end its own output early, with an exit code it could as well have exited with.
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
import tarfile
from pathlib import Path

from services.sandbox.backend import ResourceLimits
from services.sandbox.staging import REPORT_CAP_BYTES

LABEL = "dockyard.sandbox.owner"  # host/pid/process-start-time of the service that made it
SESSION_LABEL = "dockyard.sandbox.session"  # on a session's container (docker_sessions.py)
WORK = "/work"
REPORT_NAME = ".dockyard-report"
INPUT_NAME = ".dockyard-input"
# Around every command: read the end token and whether a tar follows (dash's read takes stdin byte by byte:
# the tar stays whole), unpack the work folder from stdin into the /work tmpfs, run, and end each stream with
# the end line, then wait for stdin's end (the host's word that both lines came). The token is never in an
# argv or the environment, so a command that prints its processes' does not end early; a call without files
# starts no tar.
STAGE_COMMAND = (
    'read -r end files && { [ "$files" = 0 ] || tar -x -f -; } && "$@" </dev/null; rc=$?; full=0; '
    '[ "$(stat -f -c %a .)" != 0 ] || full=1; echo "$end $rc $full"; echo "$end $rc $full" >&2; '
    "cat >/dev/null; exit $rc"
)
# The shell opens the input (then unlinks it) and the report file, then execs the harness with
# stdin = input, fd 3 = report, ready line on fd 2.
RUN_TESTS_COMMAND = f'exec 3>{REPORT_NAME} <{INPUT_NAME} && rm -f {INPUT_NAME} && exec python3 -B -u -I -c "$0" 3 2'


def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when no such process."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[1].split()[19]


def owner_label() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_process_start_time(pid)}"


def owner_is_dead(label: str) -> bool:
    """True when `label` names a service process of this host that no longer runs."""
    host, _, rest = label.partition("/")
    pid, _, started = rest.partition("/")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's: not ours to judge
    return _process_start_time(int(pid)) != started


def host_config(
    api,
    *,
    work: str,
    limits: ResourceLimits,
    user: str,
    cpus: float,
    pids_limit: int,
    max_file_bytes: int,
    max_disk_mb: int,
    tmp_mb: int,
    report: bool = True,
    route: str | None = None,
) -> dict:
    """The engine's host config of a run's container; `user` "uid:gid" owns the /work tmpfs; `report`
    False (a session's container): no host file at all, but for `route`, the host folder of a session's
    endpoint socket (endpoint_route.py), mounted read-only."""
    from docker.types import LogConfig, Mount, Ulimit

    from services.sandbox.endpoint_route import MOUNT as ROUTE_MOUNT

    memory = f"{limits.memory_mb}m"
    uid, gid = user.split(":")
    cpu = max(1, math.ceil(limits.cpu_seconds))
    return api.create_host_config(
        network_mode="none",
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        pids_limit=pids_limit,
        mem_limit=memory,
        memswap_limit=memory,
        nano_cpus=int(cpus * 1e9),
        ulimits=[
            Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
            Ulimit(name="fsize", soft=max_file_bytes, hard=max_file_bytes),
            Ulimit(name="core", soft=0, hard=0),
        ],
        mounts=[Mount(f"{WORK}/{REPORT_NAME}", os.path.join(work, REPORT_NAME), type="bind")]
        if report
        else [] + ([Mount(ROUTE_MOUNT, route, type="bind", read_only=True)] if route else []),
        tmpfs={
            "/tmp": f"rw,nosuid,nodev,size={tmp_mb}m,mode=1777",
            # Counts against the memory cgroup too: the lower of the two limits ends the run first.
            WORK: f"rw,nosuid,nodev,size={max_disk_mb}m,mode=0700,uid={uid},gid={gid}",
        },
        log_config=LogConfig(type="none"),
    )


def create_container(
    api, image: str, command: list[str], *, user: str, owner: str, config: dict, labels: dict | None = None
) -> str:
    """A created (not started) container of `image` running `command` in /work; its id."""
    return api.create_container(
        image,
        command=command,
        user=user,
        stdin_open=True,  # the work folder arrives on stdin, as a tar (closed after it: StdinOnce)
        working_dir=WORK,
        environment={"HOME": WORK},
        hostname="sandbox",
        network_disabled=True,
        labels={LABEL: owner, **(labels or {})},
        host_config=config,
    )["Id"]


def remove_container(client, container_id: str) -> None:
    """Remove a container (force), whether or not it still runs; one that is gone already, or an engine that
    fails the call, is no error: the next start's reaper removes what is left."""
    try:
        client.api.remove_container(container_id, force=True)
    except Exception:  # noqa: BLE001 -- gone already, or the engine went away
        pass


def folder_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (links not followed)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(root, name)).st_size
    return total


def send_work_folder(sock, work: str, header: bytes = b"", *, tar: bool = True, keep_open: bool = False) -> None:
    """`header` (a run's: a warm container's command, docker_warm_runs.launch_header, then run_header), then
    (`tar`) `work` (but the report file, which is bind-mounted) as a tar on the container's stdin, then EOF
    (with `keep_open`, a run's: later, by end_stdin)."""
    raw = getattr(sock, "_sock", sock)
    with raw.makefile("wb") as stream:
        stream.write(header)
        if tar:
            with tarfile.open(fileobj=stream, mode="w|") as archive:
                archive.add(work, arcname=".", filter=lambda i: None if i.name == f"./{REPORT_NAME}" else i)
    if not keep_open:
        end_stdin(sock)


def end_stdin(sock, *, close: bool = True) -> None:
    """EOF on the container's (or an exec's) stdin, the attach connection then closed unless `close` is False
    (its output still to be read); a connection gone already is no error."""
    raw = getattr(sock, "_sock", sock)
    try:
        raw.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the container, or the engine's end of the connection, is gone
    if close:
        raw.close()


def run_header(token: bytes, work: str) -> tuple[bytes, bool]:
    """STAGE_COMMAND's first line of stdin (the end token, whether a tar follows), and whether one does: not
    when `work` holds nothing but the report file."""
    files = any(name != REPORT_NAME for name in os.listdir(work))
    return token + (b" 1\n" if files else b" 0\n"), files


class EndLine:
    """One output stream of a run: the code's output passed on, STAGE_COMMAND's end line for `token` cut off.

    `end` is (exit code, /work full) once the line came; what follows it (a leftover process's) is dropped.
    A few bytes are held back until the next chunk shows they do not start the end line; `rest()` gives them
    when the stream ended without one (the container was killed)."""

    def __init__(self, token: bytes) -> None:
        self._line = re.compile(re.escape(token) + rb" (\d{1,3}) ([01])\n")
        self._hold = len(token) + len(b" 255 1\n")
        self._pending = b""
        self.end: tuple[int, bool] | None = None

    def code_output(self, chunk: bytes) -> bytes:
        if self.end is not None:
            return b""
        self._pending += chunk
        if found := self._line.search(self._pending):
            self.end = (int(found[1]), found[2] == b"1")
            output, self._pending = self._pending[: found.start()], b""
            return output
        output, self._pending = self._pending[: -self._hold], self._pending[-self._hold :]
        return output

    def rest(self) -> bytes:
        output, self._pending = self._pending, b""
        return output


def read_report(path: str) -> bytes:
    """At most REPORT_CAP_BYTES of a regular file; never follows a link the code may have planted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, REPORT_CAP_BYTES)
    finally:
        os.close(fd)
