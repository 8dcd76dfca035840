"""RunTests sandboxes that serve calls one after another, reset between them (the local backend, as root).

    LocalBackend._start_worker --> bwrap, as for any run, with CAP_KILL, CAP_DAC_OVERRIDE and a fresh
        mqueue mount --> the launcher in "serve" mode (harness.py): the harness compiled, waiting on
        its control socket
    call_worker(worker, rlimits line, harness input, limits)
        --> five fresh pipes (stdin, stdout, stderr, status, report), their far ends sent over the
            control socket (SCM_RIGHTS) with the call's rlimits line; the wall clock starts
        --> the launcher forks: the child takes them as fds 0, 1, 2 and the report fd, closes every fd
            of the launcher's, sets the call's rlimits, drops to the sandbox uid and runs the harness,
            as a one-call sandbox's child does
        --> the child ends; the launcher kills every other process of the namespace, empties the
            work folder (its mode, owner and attributes reset), finds no System V IPC object and no
            message queue left, then writes "exit <code>" and "recycle" on the call's status pipe
            and closes it: the call is over, and the sandbox serves the next one
        --> past the wall-clock limit, or when anything was left ("retire <why>"): the whole sandbox
            ends (its pid namespace with it) and is never used again

Guarantees: a call's code starts as a fresh fork of a launcher that has run nothing untrusted, under
the sandbox uid, which can neither signal, trace nor read the root launcher; before the next call is
handed over, every process an earlier call left is dead and the work folder is empty, and a
sandbox where anything survived the reset is retired, not reused; each call has its own pipes, so
no output of one reaches another (tests/unit/sandbox/test_local_warm.py). The limits, the uid drop,
the output caps, the verdict rule and the report's nonce hold per call as for a one-call sandbox.
A call is answered within its wall-clock limit plus the drain grace: a sandbox that stops answering
is killed. `WorkerGone`: the sandbox ended before the launcher reported the call's end (killed from
outside while it waited or ran the call); whatever the call ran ended with its namespace, and the
backend tries the call once more, on another sandbox, then reports an ERROR.

Why serving: on a small machine a one-call sandbox's bwrap and interpreter start is most of a small
task's cost even when started ahead (it still takes a core); a fork of a waiting interpreter is not.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass

from services.sandbox.backend import ResourceLimits
from services.sandbox.local_runs import Run, Started, captures, kill_group

# After the call's status pipe closes (the launcher is done, every process of the call killed),
# how long its output may take to arrive before we stop reading.
DRAIN_GRACE_SECONDS = 0.5
CALL_PIPES = ("stdin", "stdout", "stderr", "status", "report")


class WorkerGone(OSError):
    """The serving sandbox ended before its launcher reported the call's end."""


@dataclass
class Worker:
    started: Started  # the serving sandbox's process and its own pipes (they carry setup errors only)
    control: socket.socket | None  # our end of its control socket

    def alive(self) -> bool:
        return self.control is not None and self.started.alive()

    def kill(self) -> None:
        if self.started.proc is not None:
            kill_group(self.started.proc.pid)

    def close_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None


async def call_worker(worker: Worker, rlimits: str, harness_input: bytes, limits: ResourceLimits) -> tuple[Run, bool]:
    """One RunTests call in `worker`: (its run, whether the sandbox may serve another call)."""
    pipes = {name: os.pipe() for name in CALL_PIPES}
    theirs = [pipes["stdin"][0], *(pipes[name][1] for name in CALL_PIPES[1:])]
    call = Started(
        work=worker.started.work,
        parent_ends=[pipes["stdin"][1], *(pipes[name][0] for name in CALL_PIPES[1:])],
        captures=captures(limits.max_output_bytes),
        read=list(CALL_PIPES[1:]),
    )
    try:
        try:
            if worker.control is None:
                raise OSError("its control socket is closed")
            socket.send_fds(worker.control, [rlimits.encode()], theirs)
        finally:
            for fd in theirs:
                os.close(fd)
    except OSError as exc:
        call.close_fds()
        raise WorkerGone(f"the sandbox had ended before its call: {exc}") from None
    run = call.run
    try:
        await call.connect(pipes)
        start = time.monotonic()
        assert call.stdin is not None
        call.stdin.write(harness_input)
        call.stdin.close()  # flushes what is buffered, then closes: the harness sees EOF
        done = call.captures["status"].closed
        try:
            await asyncio.wait_for(asyncio.shield(done), limits.timeout_seconds)
        except TimeoutError:
            run.timed_out = True
            worker.kill()  # the call's processes and the sandbox: nothing of it may run on
        run.duration = time.monotonic() - start
        readers = [call.captures[name].closed for name in call.read]
        await asyncio.wait(readers, timeout=DRAIN_GRACE_SECONDS)
    finally:
        call.close_fds()
    call.collect()
    said = bytes(call.captures["status"].data).decode("utf-8", errors="replace").splitlines()
    if not run.timed_out and not any(line.startswith("exit ") for line in said):
        # The sandbox ended (killed from outside, or the OOM killer) before the launcher reported the
        # call: its verdict cannot be trusted, and whatever the call ran ended with the namespace.
        worker.kill()
        raise WorkerGone("the sandbox ended during the call" if "ready" in said else "the sandbox had ended")
    return run, not run.timed_out and "recycle" in said
