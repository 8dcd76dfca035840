"""How a docker session's container starts, cold (docker_sessions.py) or warm (docker_warm.py): one way for both.

    stage_session_files --> a host folder <-- seed_dir copy, then files; refused (FailedPrecondition)
        beyond max_disk_mb
    start_session_container(config, limits, route, work, labels)
        --> docker_container.create_container with config.host(report=False, route): the host config
              of a run without the report bind (no host path but a route's folder, read-only);
              labels owner + dockyard.sandbox.session (+ `labels`: a warm one's dockyard.sandbox.warm)
        --> PID 1: REAPER_SOURCE (routed: endpoint_route.ROUTED_PID1_SOURCE); with `work` (cold) first
              OPEN_COMMAND's `tar -x` of that folder, sent on stdin, into the /work tmpfs
        --> attached before start, started, READY read (wait_ready); its id

Guarantees: a cold and a warm session's container get the same create options, host config, user,
PID 1 and readiness check, whatever the caller; they differ only in what `work` and `labels` say
(files untarred before PID 1, or /work left empty; the warm label). A container that fails any step
after its creation is removed (a removal that fails is left to the next start's reaper); a missing
image is a FailedPrecondition naming deploy/images/build.sh. Both functions block: callers run them
in a worker thread. `config` is a docker_sessions.DockerSessionConfig.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping

from dockyard.rpc.errors import FailedPrecondition
from services.sandbox.backend import ResourceLimits
from services.sandbox.docker_container import (
    SESSION_LABEL,
    create_container,
    folder_bytes,
    remove_container,
    send_work_folder,
)
from services.sandbox.endpoint_route import READY, ROUTED_PID1_SOURCE
from services.sandbox.staging import remove_tree, stage_files

# PID 1 of the container: reap orphans, nothing else; SIGTERM (docker stop) ends it. It says READY
# once its signals are set up (a routed session's PID 1 once its route listens: endpoint_route.py).
REAPER_SOURCE = rf"""
import os, signal
signals = {{signal.SIGCHLD, signal.SIGTERM}}
signal.pthread_sigmask(signal.SIG_BLOCK, signals)
os.write(1, b"{READY.decode()}\n")
while True:
    if signal.sigwait(signals) == signal.SIGTERM:
        os._exit(0)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""
# A cold container's: the work folder's tar from stdin into /work, then PID 1's source ($0).
OPEN_COMMAND = 'tar -x -f - && exec python3 -I -S -c "$0"'


def stage_session_files(config, checked, seed_dir: str | None) -> str:
    """A host folder holding the session's work folder (seed copy, then files), at most max_disk_mb; the
    caller removes it."""
    stage = tempfile.mkdtemp(prefix="dockyard-session-stage-", dir=config.work_root)
    try:
        stage_files(stage, checked, seed_dir)
        size = folder_bytes(stage)
        if size > config.max_disk_mb * 1024 * 1024:
            raise FailedPrecondition(f"the session's files ({size} bytes) exceed DOCKYARD_SANDBOX_MAX_DISK_MB")
    except BaseException:
        remove_tree(stage)
        raise
    return stage


def start_session_container(
    config,
    limits: ResourceLimits,
    *,
    route: str | None,
    work: str | None,
    labels: Mapping[str, str] | None = None,
) -> str:
    """A session's container, created, started and its PID 1 READY; its id. Blocks.

    `route`: the host folder of the session's endpoint socket (PID 1 the forwarder), else PID 1 the reaper.
    `work`: a host folder sent as a tar on stdin into /work before PID 1 starts (a cold open); None: /work
    stays empty (a warm container, its files copied in when taken). `labels` go on top of SESSION_LABEL.
    A container that fails any step is removed; a missing image is a FailedPrecondition."""
    import docker.errors

    api = config.client.api
    source = ROUTED_PID1_SOURCE if route else REAPER_SOURCE
    command = ["python3", "-I", "-S", "-c", source] if work is None else ["sh", "-c", OPEN_COMMAND, source]
    host = config.host(work=work or "", limits=limits, report=False, route=route)
    container_id = None
    try:
        container_id = create_container(
            api,
            config.image,
            command,
            user=config.user,
            owner=config.owner,
            config=host,
            labels={SESSION_LABEL: "1", **(labels or {})},
        )
        # Attached before start: PID 1's READY is not missed, and a cold open's tar meets a reading shell.
        stream = api.attach(container_id, stdout=True, stderr=True, stream=True, logs=False, demux=True)
        stdin = api.attach_socket(container_id, params={"stdin": 1, "stream": 1}) if work is not None else None
        api.start(container_id)
        if work is not None:
            send_work_folder(stdin, work)
        wait_ready(stream)
        return container_id
    except BaseException as exc:
        if container_id is not None:
            remove_container(config.client, container_id)
        if isinstance(exc, docker.errors.ImageNotFound):
            message = f"image {config.image!r} not found: build it with deploy/images/build.sh"
            raise FailedPrecondition(message) from None
        raise


def wait_ready(stream) -> None:
    """Read a starting session container's attach stream until its PID 1 says READY; then close it."""
    said = b""
    for chunk_out, chunk_err in stream:
        said = (said + (chunk_out or b"") + (chunk_err or b""))[-4096:]
        if READY in said:
            break
    stream.close()
    if READY not in said:
        raise RuntimeError(f"the session's container did not start: {said[-500:]!r}")
