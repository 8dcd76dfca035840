"""Hostile code against the local backend, as the service builds it: one property per test.

Each test runs one attack through `make_backend` (bubblewrap namespaces, the
sandbox uid when the service is root) and checks from the host the one property
it is about; where the property could hold vacuously, the test first checks that
the same thing works from the host (the file is readable, the socket answers).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from services.sandbox.__main__ import make_backend
from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.settings import SandboxSettings
from tests.conftest import missing, require_tool

LIMITS = ResourceLimits(timeout_seconds=20.0, memory_mb=512, cpu_seconds=10.0, max_output_bytes=65536)


@pytest.fixture
async def backend(tmp_path: Path):
    require_tool(shutil.which("bwrap") or "/usr/bin/bwrap", "bubblewrap (bwrap)")
    work_root = tmp_path / "work"
    work_root.mkdir()
    backend = await make_backend(SandboxSettings(backend="local", max_concurrency=2, work_root=str(work_root)))
    yield backend
    await backend.close()


async def run(backend, source: str, seed_dir: str | None = None, args: tuple[str, ...] = ()):
    files = {"main.py": textwrap.dedent(source)}
    out = await backend.execute(files, ["python", "main.py", *args], LIMITS, seed_dir=seed_dir)
    assert out.status in (Status.PASSED, Status.FAILED), out
    return out


def host_processes(token: str, *, argv_tail: list[str] | None = None) -> list[int]:
    """Live (not zombie) processes of this host whose command line holds `token` (or, given
    `argv_tail`, whose arguments after argv[0] are exactly it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        args = cmdline.decode(errors="replace").split("\0")[1:-1]
        match = args == argv_tail if argv_tail is not None else token.encode() in cmdline
        if match and stat[stat.rindex(")") + 2] != "Z":
            found.append(int(entry.name))
    return found


async def test_cannot_read_etc_shadow(backend):
    if os.geteuid() == 0:
        assert Path("/etc/shadow").read_bytes(), "the host's root can read it: the sandbox must not"
    out = await run(backend, "print(len(open('/etc/shadow', 'rb').read()))")
    assert out.status is Status.FAILED
    assert "Error" in out.stderr and out.stdout == ""


async def test_cannot_read_another_process_environment(backend):
    secret = f"sibling-secret-{uuid.uuid4().hex}"
    sibling = subprocess.Popen(["sleep", "60"], env={"SIBLING_TOKEN": secret})
    try:
        deadline = time.monotonic() + 5.0  # from the host it is there, once `sleep` is exec'd
        while secret.encode() not in Path(f"/proc/{sibling.pid}/environ").read_bytes():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        out = await run(
            backend,
            """
            import json, os
            pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]
            seen = []
            for pid in pids:
                try:
                    seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace'))
                except OSError:
                    pass
            print(json.dumps({'pids': pids, 'environ': seen}))
            """,
        )
        inside = json.loads(out.stdout)
        assert secret not in out.stdout
        assert sibling.pid not in inside["pids"]
    finally:
        sibling.kill()
        sibling.wait()


CONNECT = """
import socket, sys
for address in {addresses!r}:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(address)
        s.sendall(b'GET /_ping HTTP/1.0\\r\\n\\r\\n')
        print('CONNECTED', address, s.recv(64))
    except OSError as exc:
        print('refused', address, type(exc).__name__)
"""


async def test_cannot_reach_the_docker_socket(backend):
    sockets = [p for p in ("/var/run/docker.sock", "/run/docker.sock") if os.path.exists(p)]
    if not sockets:
        missing("no docker socket on this host")
    with socket.socket(socket.AF_UNIX) as probe:  # the host reaches it
        probe.connect(sockets[0])
    out = await run(backend, CONNECT.format(addresses=sockets))
    assert "CONNECTED" not in out.stdout
    assert out.stdout.count("refused") == len(sockets)


async def test_cannot_reach_host_unix_or_abstract_sockets(backend, tmp_path):
    path = str(tmp_path / "host.sock")
    abstract = f"\0dockyard-test-{uuid.uuid4().hex}"
    listeners = []
    for address in (path, abstract):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
        with socket.socket(socket.AF_UNIX) as probe:  # the host reaches both
            probe.connect(address)
        listener.accept()[0].close()
    try:
        out = await run(backend, CONNECT.format(addresses=[path, abstract]))
        assert "CONNECTED" not in out.stdout
        assert out.stdout.count("refused") == 2
        for listener in listeners:
            with pytest.raises(BlockingIOError):  # nobody connected from the sandbox
                listener.accept()
    finally:
        for listener in listeners:
            listener.close()


async def test_cannot_write_outside_its_work_folder(backend, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    fresh = tmp_path / "fresh.txt"
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "planted").symlink_to(victim)  # a symlink in the seed that points at a host file
    out = await run(
        backend,
        f"""
        import os, sys
        os.symlink({str(fresh)!r}, 'made')
        for target in ('planted', 'made', {str(victim)!r}, {str(fresh)!r}, '/owned', sys.prefix + '/owned',
                       '/tmp/owned', '/dev/shm/owned'):
            try:
                with open(target, 'w') as f:
                    f.write('owned')
                print('WROTE', target)
            except OSError as exc:
                print('refused', target, type(exc).__name__)
        """,
        seed_dir=str(seed),
    )
    assert "WROTE" not in out.stdout, out.stdout
    assert victim.read_text() == "untouched"
    assert not fresh.exists()
    assert not Path(os.path.realpath(sys.prefix), "owned").exists()


async def test_no_process_survives_the_verdict(backend):
    token = f"{uuid.uuid4().int % 10**6}.25"  # a unique sleep length, to find it from the host
    out = await run(
        backend,
        f"""
        import os, subprocess
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp('sleep', ['sleep', '{token}'])
            os._exit(0)
        subprocess.Popen(['sleep', '{token}'], start_new_session=True)
        import time
        time.sleep(0.5)
        print('started')
        """,
    )
    assert out.status is Status.PASSED and "started" in out.stdout, out
    deadline = time.monotonic() + 2.0  # SIGKILL is sent at once; the kernel takes a moment to act on it
    while host_processes(token) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert host_processes(token) == []


async def test_runs_as_a_non_root_uid_without_capabilities(backend):
    token = f"uid-probe-{uuid.uuid4().hex}"  # an argument: in the command line, found from the host
    source = """
    import json, os, time
    status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
    print(json.dumps({'uid': os.getuid(), 'euid': os.geteuid(), 'gid': os.getgid(), 'groups': os.getgroups(),
                      'caps': [status[k].strip() for k in ('CapPrm', 'CapEff', 'CapAmb')]}), flush=True)
    time.sleep(1.5)
    """
    task = asyncio.ensure_future(run(backend, source, args=(token,)))
    host_uids = set()
    deadline = time.monotonic() + 10.0
    while not task.done() and time.monotonic() < deadline:
        # The code's own process, not the launcher or bwrap around it (they are trusted, and root).
        for pid in host_processes(token, argv_tail=["-B", "-u", "-E", "-s", "main.py", token]):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):  # it ended between the listing and the read
                continue
            for line in status.splitlines():
                if line.startswith("Uid:"):
                    host_uids.update(int(v) for v in line.split()[1:])
        await asyncio.sleep(0.05)
    out = await task
    inside = json.loads(out.stdout)
    assert inside["uid"] != 0 and inside["euid"] != 0 and inside["gid"] != 0 and 0 not in inside["groups"]
    assert inside["caps"] == ["0000000000000000"] * 3  # permitted, effective, ambient
    assert host_uids and 0 not in host_uids  # the host, too, sees an unprivileged uid


async def test_has_no_network(backend):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        out = await run(
            backend,
            f"""
            import socket
            print('interfaces', sorted(name for _, name in socket.if_nameindex()))
            for host in ('127.0.0.1', '1.1.1.1', '172.17.0.1'):
                try:
                    socket.create_connection((host, {port}), timeout=1).close()
                    print('CONNECTED', host)
                except OSError as exc:
                    print('refused', host, type(exc).__name__)
            """,
        )
        assert "interfaces ['lo']" in out.stdout
        assert "CONNECTED" not in out.stdout
        with pytest.raises(BlockingIOError):  # the host's loopback listener saw nobody
            listener.accept()
    finally:
        listener.close()


async def test_interpreter_and_stdlib_still_work(backend):
    out = await run(
        backend,
        """
        import json, subprocess, sys, tempfile, zipfile, sqlite3, hashlib
        print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())
        with tempfile.TemporaryFile() as f:
            f.write(b'x')
        print(sqlite3.connect(':memory:').execute('select 1').fetchone()[0])
        """,
    )
    assert out.status is Status.PASSED, out
    assert out.stdout.split() == ["42", "1"]
