"""A supervised service dies with its parent process, and only with it: not with the parent's
thread that happened to start it (a restart from a worker thread), as PR_SET_PDEATHSIG would."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dockyard.rpc.client import health_status
from tests.conftest import REPO_ROOT, free_port

pytestmark = pytest.mark.slow

# Starts the buffer service from a thread that ends once the service serves; prints the service's
# pid, "serving" and "thread ended"; waits.
PARENT = """
import asyncio, os, subprocess, sys, threading, time
from dockyard.rpc.client import wait_until_serving
from dockyard.rpc.launch import PARENT_PID_ENV
env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "DOCKYARD_BUFFER_PORT": sys.argv[1]}
def spawn():
    child = subprocess.Popen([sys.executable, "-m", "services.buffer"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    asyncio.run(wait_until_serving("127.0.0.1:" + sys.argv[1], timeout=60))
    print("serving", flush=True)
thread = threading.Thread(target=spawn)
thread.start()
thread.join()
print("thread ended", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_service_outlives_the_thread_that_started_it_but_not_its_parent() -> None:
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())
        lines = [parent.stdout.readline().strip() for _ in range(2)]
        assert lines == ["serving", "thread ended"], lines
        time.sleep(1.5)  # a signal tied to the thread would have come by now
        # SIGTERM makes a service report NOT_SERVING at once, then drain before it exits.
        assert asyncio.run(health_status(f"127.0.0.1:{port}")) == "SERVING", "it stopped with the thread"
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while alive(child):
            assert time.monotonic() < deadline, "the service outlived its parent"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()
