"""The container of one docker-backend run: its limits, its owner label, and what crosses into and out of it.

    limits --host_config--> network none, read-only root, cap_drop ALL, no-new-privileges,
                            pids / memory (= swap) / CPU-quota limits, ulimits cpu, fsize, core = 0,
                            /work a tmpfs of max_disk_mb, tmpfs /tmp, /work/REPORT_NAME a bind of one
                            host file, log driver none
           --create_container--> created, not started; user, label dockyard.sandbox.owner = owner_label()
    command --STAGE_COMMAND--> sh: untar stdin into /work, run, flag a full /work in the report file
            (RunTests: RUN_TESTS_COMMAND opens and unlinks the input, then execs the harness)
    host work folder --send_work_folder--> a tar on the container's stdin (the report file left out), EOF
    host report file --read_report--> at most REPORT_CAP_BYTES, never through a link
    owner_is_dead(label) --> the reaper removes a dead predecessor's containers

Guarantees: every container gets the same locked-down host config, whatever the
command; the only host path it sees is the report file; reading the report never
follows a link the code planted and never blocks on a fifo; a label names a dead
owner only for this host and only when that process (pid and start time) is gone,
so a reused pid never passes for its predecessor.
"""

from __future__ import annotations

import math
import os
import socket
import stat
import tarfile
import threading
from concurrent.futures import Future
from pathlib import Path

from services.sandbox.backend import ResourceLimits
from services.sandbox.staging import REPORT_CAP_BYTES

LABEL = "dockyard.sandbox.owner"  # host/pid/process-start-time of the service that made it
SESSION_LABEL = "dockyard.sandbox.session"  # on a session's container (docker_sessions.py)
WORK = "/work"
REPORT_NAME = ".dockyard-report"
INPUT_NAME = ".dockyard-input"
# Around every command: unpack the work folder from stdin into the /work tmpfs, run, and flag a
# /work left full in the report file (the only channel back that the host can read afterwards).
DISK_FULL_FLAG = "dockyard-disk-full"
STAGE_COMMAND = (
    f'tar -x -f - && "$@" </dev/null; rc=$?; [ "$(stat -f -c %a .)" != 0 ] || echo {DISK_FULL_FLAG} >>{REPORT_NAME}; '
    "exit $rc"
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


def exit_state(api, container_id: str, timeout: float) -> Future:
    """The engine's wait for the container's exit, asked now in a thread of its own (so the answer is there
    as soon as its output ends, not a round trip later): a Future of the wait's reply."""
    answer: Future = Future()

    def wait() -> None:
        try:
            answer.set_result(api.wait(container_id, timeout=timeout))
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            answer.set_exception(exc)

    threading.Thread(target=wait, name="sandbox-wait", daemon=True).start()
    return answer


def folder_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (links not followed)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(root, name)).st_size
    return total


def send_work_folder(sock, work: str, header: bytes = b"") -> None:
    """`header` (a warm container's command: docker_warm_runs.launch_header), then `work` (but the report
    file, which is bind-mounted) as a tar on the container's stdin, then EOF."""
    raw = getattr(sock, "_sock", sock)
    with raw.makefile("wb") as stream:
        stream.write(header)
        with tarfile.open(fileobj=stream, mode="w|") as tar:
            tar.add(work, arcname=".", filter=lambda info: None if info.name == f"./{REPORT_NAME}" else info)
    raw.shutdown(socket.SHUT_WR)
    raw.close()


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
