"""The local backend's runs end with the service process, however it ends (exit, SIGKILL, the OOM killer).

    LocalBackend's first isolated run --> RunGuard.start(): `python -I -S -c GUARD_SOURCE MARK PGID ...`,
        in a session of its own (a terminal's Ctrl-C never reaches it), reading a pipe that only the
        service holds; every bwrap of the service carries MARK in its command line (bwrap.py)
    the service dies --> the pipe's EOF --> the guard SIGKILLs every process whose command line holds
        MARK (bwrap and the namespace's init, whose death ends the namespace) and the process group
        such a process leads (a run's: bwrap leads it; the launcher and the code are in it),
        scanning again until none is found for SETTLE_SECONDS (a spawn the service had begun still
        execs bwrap then), then exits
    LocalBackend.close() --> (after its own killpg of each run) "closed" down the pipe, which is closed:
        the guard scans until none is found and exits; close waits for it

Why: bwrap's --die-with-parent is a parent-death signal on bwrap itself, set once it has made the
namespace; the namespace's init waits on an event from bwrap and sets its own only at the end of
its setup. The service dying in that window (bwrap killed by its signal, or not yet holding one)
leaves the init orphaned, blocked or running the code with no wall-clock limit, and as a pid
namespace's init it ignores SIGTERM (tests/unit/sandbox/test_run_guard.py holds bwrap there).

Guarantees: the guard signals only processes whose command line holds MARK (a random name, one
per backend) and the process groups they lead, never the service's own group (PGID) or itself; it
ends within MAX_SECONDS of the pipe's EOF whatever it finds.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import weakref

# After an EOF with no "closed" first (the service died), how long the guard keeps scanning.
SETTLE_SECONDS = 1.0
# The guard gives up after this long, so it never outlives the service by more.
MAX_SECONDS = 30.0

GUARD_SOURCE = r"""
import os, signal, sys, time
mark, spared, settle, longest = sys.argv[1].encode(), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
told = b""
while chunk := os.read(0, 4096):
    told += chunk
settle = 0.0 if told.startswith(b"closed") else settle  # closing: the service killed its runs itself
me, start = os.getpid(), time.monotonic()
while True:
    found = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if mark not in f.read():
                    continue
            found += 1
            if os.getpgid(pid) == pid and pid not in (spared, me):  # a run's group, which bwrap leads
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone meanwhile, or not ours to signal
    waited = time.monotonic() - start
    if (not found and waited >= settle) or waited >= longest:
        break
    time.sleep(0.05)
"""


class RunGuard:
    """One per backend: `mark` goes into each bwrap's command line; start() before the first spawn."""

    def __init__(self) -> None:
        self.mark = f"DOCKYARD_SANDBOX_RUN_{secrets.token_hex(8)}"
        self._proc: subprocess.Popen | None = None
        self._pipe: int | None = None
        self._release: weakref.finalize | None = None  # closes the pipe once: at close(), or when dropped

    def start(self) -> None:
        """Start the guard unless it runs; OSError when it cannot be spawned. Blocks for the spawn."""
        if self._proc is not None:
            return
        read, write = os.pipe()  # neither end is inheritable: no run holds the write end open
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", GUARD_SOURCE, self.mark, str(os.getpgid(0))]
                + [str(SETTLE_SECONDS), str(MAX_SECONDS)],
                stdin=read,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write
        # A backend dropped without close() (a test's) ends its guard too, which then sweeps its runs.
        self._release = weakref.finalize(self, os.close, write)

    def close(self) -> None:
        """Tell the guard the runs are killed, let it sweep what is left, wait for it. Blocks."""
        if self._pipe is None or self._proc is None or self._release is None:
            return
        try:
            os.write(self._pipe, b"closed\n")
        finally:
            self._release()
            self._pipe = None
        try:
            self._proc.wait(MAX_SECONDS + 5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
