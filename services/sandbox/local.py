"""The local-process backend: each run is a child process on this host, in its own namespaces.

    Execute / sessions:
    request --> host stage folder (mkdtemp, 0700) <-- seed_dir copy, then files (relative paths only),
                  written in a worker thread: the event loop keeps serving meanwhile
            --> bwrap: net, pid, ipc, uts, cgroup and mount namespaces (a user namespace when the
                  service is not root); read-only system paths and interpreter, nothing else of the
                  host; the work folder a tmpfs of max_disk_mb at the stage's path; a seccomp filter
                  refusing the kernel keyring syscalls (seccomp.py)
            --> launcher (pid 2, python -I -S): copies the stage in through an fd, forks; the child sets
                  rlimits (AS, CPU, FSIZE, CORE=0, NPROC), drops to `user` when root, execs argv;
                  scrubbed environment, cwd = HOME = TMPDIR = work folder
            --> stdout / stderr read as they come, each kept up to max_output_bytes
            --> exit: the launcher reports "disk-full" and the exit code, the pid namespace ends;
                  wall-clock limit: SIGKILL to bwrap's group, which holds the namespace's init
            --> Outcome; the stage folder is removed whatever happened

    RunTests (the scoring path):
    as root: serving sandboxes (local_workers.py), max_concurrency of them, each taking calls one
    after another: a fresh forked child per call, the sandbox reset (every process killed, the work
    folder emptied) between calls, retired when anything survives the reset or the wall clock passes
    otherwise: a sandbox started ahead of its call (warm_pool.py), serving that one call
            --> bwrap as above, the work folder a tmpfs at a path never made on the host
            --> launcher (python -B -u -I: the harness's interpreter), waiting on stdin
    request --> stdin: the call's rlimits line, then the nonce and payload; the wall clock starts
            --> the launcher forks; the child sets the call's rlimits, drops to `user` when root,
                  closes the launcher's fds and runs the harness in-process (harness.py); then as
                  above; the pid namespace ends with the call

Guarantees: the code sees no host file but read-only system paths and the
interpreter, can write only its work folder (at most `max_disk_mb` in total; a
run that leaves it full is FAILED, saying so), has no network and no host
socket, sees no other process, cannot reach the uid's kernel keyring, runs as a non-root uid
without capabilities, and
no process of it outlives its run (the pid namespace ends with the launcher); it
never outlives its wall-clock limit; it sees none of the service's environment
variables; output beyond the cap is drained and dropped, never buffered; at most
`max_concurrency` runs execute at once; after `close` (the service stopping) no
run is left alive, one spawning meanwhile included, and none starts; once the service process is
gone, however it went (SIGKILL included), the guard (run_guard.py) kills what is left of its
isolated runs. `open` refuses a host where the namespaces do not work, unless told to run
unisolated (then only the environment, rlimits, group kill and output cap hold). A RunTests
sandbox started ahead of its call runs only its own setup (serving: and earlier calls it was reset
after) until the call reaches it: nothing one call leaves (files, processes, environment, modules)
reaches another (tests/unit/sandbox/test_local_warm.py); close() discards the waiting ones, and an
isolated RunTests run leaves no host folder at all.

Limits are applied by a tiny launcher between fork and exec rather than by
subprocess's preexec_fn, which is unsafe in a threaded process (gRPC is).
Python commands ("python", "python3") run with the service's interpreter:
the RunTests harness in isolated mode (-I), in the launcher's forked child
rather than a second interpreter start; Execute commands with -E -s,
which is -I minus -P, so a multi-file program can import its own modules
from the work folder.

Verdict rule (verdicts.py, shared with the docker backend): ERROR only when
the infrastructure failed: the work folder could not be made or written, the
sandbox could not be set up, the process could not be spawned or exec'd, or
the test harness never started. Anything the code does to itself -- raising,
sys.exit, os._exit, MemoryError under RLIMIT_AS, a segfault, SIGXCPU from
RLIMIT_CPU, SIGXFSZ, a full work folder, killing the harness before it
reports -- is the policy's fault: FAILED. The wall-clock kill is TIMEOUT.

The bubblewrap command line is built in bwrap.py, the launcher's status lines
parsed in harness.py; staging.py stages the files, as for the docker backend.

Not covered: the kernel is shared with the host; RLIMIT_NPROC counts every
task of the sandbox uid across runs; there is no memory, pids or CPU cgroup.

Sessions (local_sessions.py) use run_kept: the same run, whose launcher afterwards kills every
process of the run and copies the work folder out into a host folder the session keeps.

Why over 400 lines: the bubblewrap arguments live in bwrap.py, the file staging in staging.py,
sessions in local_sessions.py, a run's pipes and their parsing in local_runs.py, the guard of a
dead service's runs in run_guard.py, the warm pool in warm_pool.py and a serving sandbox's calls in
local_workers.py; what is left is one
backend's spawn (_start), limits, waiting and cleanup (_finish), which read as one sequence.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import structlog

from dockyard.rpc.errors import FailedPrecondition, InvalidArgument
from services.sandbox.backend import (
    Outcome,
    ResourceLimits,
    SandboxBackend,
    Status,
)
from services.sandbox.bwrap import read_only_binds, sandbox_argv
from services.sandbox.harness import HARNESS_SOURCE, LAUNCHER_SOURCE
from services.sandbox.local_runs import Run, Started, captures, kill_group, uncancelled
from services.sandbox.local_sessions import open_local_session, reap_dead_sessions
from services.sandbox.local_workers import Worker, WorkerGone, call_worker
from services.sandbox.run_guard import RunGuard
from services.sandbox.seccomp import filter_pipe
from services.sandbox.staging import (
    checked_files,
    parse_report,
    remove_tree,
    stage_files_off_loop,
)
from services.sandbox.verdicts import command_verdict, tests_verdict
from services.sandbox.warm_pool import WarmPool
from services.sandbox.work_folders import WorkFolders

log = structlog.get_logger()

UNISOLATED_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`) on a kernel that allows namespaces, use "
    "DOCKYARD_SANDBOX_BACKEND=docker, or set DOCKYARD_SANDBOX_ALLOW_UNISOLATED=1 to run untrusted code "
    "on this host without isolation (it can then read the host's files, open sockets and outlive its run)"
)
PROBE_LIMITS = ResourceLimits(timeout_seconds=30.0, memory_mb=512, cpu_seconds=10.0, max_output_bytes=4096)

# The service interpreter's folder first: a shell line's `python3` or `pytest` is the interpreter a
# `python` argv gets (read-only, like the docker image's /opt/venv/bin first on its PATH).
SANDBOX_PATH = f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"
PYTHON_NAMES = frozenset({"python", "python3"})
# After the main process exits and its group is killed, how long pipes may
# stay open (held by a process that escaped the group) before we stop reading.
DRAIN_GRACE_SECONDS = 0.5


def sandbox_environment(work: str) -> dict[str, str]:
    """The whole environment of the code: nothing is inherited from the service."""
    return {
        "PATH": SANDBOX_PATH,
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
    }


class LocalBackend(SandboxBackend):
    def __init__(
        self,
        *,
        max_concurrency: int,
        max_file_mb: int = 64,
        max_disk_mb: int = 256,
        max_processes: int = 256,
        work_root: str | None = None,
        user: str = "65534:65534",
        isolate: bool = True,
    ) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        self._max_file_bytes = max_file_mb * 1024 * 1024
        self._max_disk_bytes = max_disk_mb * 1024 * 1024
        self._max_processes = max_processes
        self._work_root = work_root
        self._folders = WorkFolders(work_root)
        # As root the code runs as `user`; otherwise as the service's own (unprivileged) uid.
        self._user = user if os.geteuid() == 0 else "-"
        self._bwrap = shutil.which("bwrap") if isolate else None
        self._isolate = isolate
        self._binds = read_only_binds() if isolate else []
        self._live_groups: set[int] = set()
        self._closed = False  # close() ran: no run starts, and one spawning meanwhile is killed at once
        self._guard = RunGuard()  # kills the isolated runs once the service is gone, however it went
        # RunTests sandboxes started ahead of their calls, one per slot. As root, each serves calls one
        # after another, reset between them (local_workers.py); otherwise each serves one call.
        serving = isolate and self._user != "-"
        self._workers: WarmPool[Worker] | None = (
            WarmPool(self._start_worker, self._discard_worker, Worker.alive, size=max_concurrency, reuse=True)
            if serving
            else None
        )
        self._warm: WarmPool[Started] = WarmPool(
            self._start_harness, self._discard_harness, Started.alive, size=max_concurrency if isolate else 0
        )

    @classmethod
    async def open(cls, *, allow_unisolated: bool = False, **kwargs) -> LocalBackend:
        """An isolated backend once a probe run passes; unisolated only when `allow_unisolated`."""
        backend = cls(isolate=True, **kwargs)
        problem = await backend.isolation_problem()
        if not problem:
            return backend
        await backend.close()  # its guard and .owner file go with it
        if not allow_unisolated:
            raise RuntimeError(f"the local sandbox cannot isolate its runs ({problem}): {UNISOLATED_HINT}")
        log.warning("local sandbox runs WITHOUT isolation (DOCKYARD_SANDBOX_ALLOW_UNISOLATED=1)", problem=problem)
        return cls(isolate=False, **kwargs)

    async def isolation_problem(self) -> str:
        """Why an isolated run does not work here; empty when one does."""
        if self._bwrap is None:
            return "bwrap (bubblewrap) is not installed"
        out = await self.execute({}, ["python", "-c", "pass"], PROBE_LIMITS)
        if out.status is Status.PASSED:
            return ""
        return f"a probe run ended {out.status.value}: {out.error_message} {out.stderr}".strip()

    async def execute(
        self,
        files: Mapping[str, str],
        command: Sequence[str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
    ) -> Outcome:
        del image  # local processes run on the host's own interpreter
        if not command or not command[0]:
            raise InvalidArgument("command: must name the program to run")
        checked = checked_files(files)
        argv = self.python_argv(command)
        async with self._slots:
            try:
                work = await self._folders.make_off_loop()
            except OSError as exc:
                return Outcome(Status.ERROR, tests_total=1, error_message=f"cannot create the work folder: {exc}")
            try:
                try:
                    await stage_files_off_loop(work, checked, seed_dir)
                except OSError as exc:
                    return Outcome(Status.ERROR, tests_total=1, error_message=f"cannot write the files: {exc}")
                run = await self._run(argv, work, limits, staged=bool(checked) or seed_dir is not None)
            finally:
                await asyncio.to_thread(remove_tree, work)
        return command_verdict(run)

    async def run_tests(self, program: str, tests: Sequence[str], limits: ResourceLimits) -> Outcome:
        if not tests:
            raise InvalidArgument("tests: at least one test is required (no tests would pass vacuously)")
        nonce = secrets.token_hex(16).encode()
        payload = json.dumps({"program": program, "tests": list(tests)}).encode()
        harness_input = nonce + b"\n" + payload
        total = len(tests)
        async with self._slots:
            try:
                if self._workers is not None:
                    run = await self._serve(harness_input, limits)
                else:
                    run = await self._run_once(harness_input, limits)
            except OSError as exc:
                return Outcome(Status.ERROR, tests_total=total, error_message=f"cannot start the sandbox: {exc}")
        # The harness writes its ready line to the report pipe, which the code cannot unwrite.
        started, results = parse_report(run.report, nonce, total)
        return tests_verdict(run, total=total, started=started, results=results)

    async def _run_once(self, harness_input: bytes, limits: ResourceLimits) -> Run:
        """A RunTests call in a sandbox of its own, which then ends. OSError when none could start."""
        started = await self._warm.take()
        try:
            # The limits line first: the launcher reads it; the harness reads the rest.
            return await self._finish(started, limits, self.rlimits_line(limits).encode() + b"\n" + harness_input)
        finally:
            if not self._isolate:  # isolated, the work folder was never made on the host
                await asyncio.to_thread(remove_tree, started.work)

    async def _serve(self, harness_input: bytes, limits: ResourceLimits) -> Run:
        """A RunTests call in a serving sandbox; tried once more on another when the one taken ended
        before reporting the call's end (whatever it ran ended with it). OSError when none could."""
        try:
            return await self._call_worker(harness_input, limits)
        except WorkerGone:
            return await self._call_worker(harness_input, limits)

    async def _call_worker(self, harness_input: bytes, limits: ResourceLimits) -> Run:
        """The call in a serving sandbox, given back for the next call only when the launcher reset it
        (a cancelled call's sandbox is discarded, and with it whatever the call was running)."""
        assert self._workers is not None
        worker = await self._workers.take()
        reusable = False
        try:
            run, reusable = await call_worker(worker, self.rlimits_line(limits), harness_input, limits)
        finally:
            await self._workers.give_back(worker, reusable=reusable)
        return run

    async def open_session(
        self,
        files: Mapping[str, str],
        limits: ResourceLimits,
        *,
        seed_dir: str | None = None,
        image: str | None = None,
        endpoint_address: str = "",
    ):
        if endpoint_address:
            raise FailedPrecondition(
                "a session with a route to the policy endpoint (an external scaffold's) needs the docker backend: "
                "set DOCKYARD_SANDBOX_BACKEND=docker (the local backend has no network but none)"
            )
        del limits, image  # each command gets the session's limits itself; no images here
        return await open_local_session(
            self, files, seed_dir=seed_dir, work_root=self._work_root, max_disk_bytes=self._max_disk_bytes
        )

    def reap_sessions(self) -> int:
        return reap_dead_sessions(self._work_root)

    async def close(self) -> None:
        """Kill every run's process group; a run that was spawning meanwhile is killed as soon as it
        exists, and none starts after this (an unkilled one would outlive the service, orphaned)."""
        self._closed = True
        for pgid in list(self._live_groups):
            kill_group(pgid)
        await self._warm.close()  # the waiting sandboxes' folders go too
        if self._workers is not None:
            await self._workers.close()
        await asyncio.to_thread(self._guard.close)
        await asyncio.to_thread(self._folders.close)

    @property
    def isolated(self) -> bool:
        return self._isolate

    @property
    def run_mark(self) -> str:
        """The name every bwrap of this backend carries in its command line (run_guard.py)."""
        return self._guard.mark

    def python_argv(self, command: Sequence[str]) -> list[str]:
        """`command`, with "python" / "python3" run by the service's interpreter (-E -s, as Execute)."""
        argv = list(command)
        if argv[0] in PYTHON_NAMES:
            argv = [sys.executable, "-B", "-u", "-E", "-s", *argv[1:]]
        return argv

    async def run_kept(
        self, argv: list[str], work: str, keep: str, limits: ResourceLimits, stdin: bytes | None, groups: set[int]
    ) -> tuple[Outcome, bool, str]:
        """A session's command: `work` staged in, run, then the run's folder copied out into the empty
        host folder `keep` after every process of the run is killed. (Outcome, kept, why not kept);
        a wall-clock kill keeps nothing. `groups` holds the run's process group while it runs (for a
        kill from outside). Isolated backends only (the copy-out runs in the sandbox)."""
        async with self._slots:
            run = await self._run(argv, work, limits, stdin=stdin, staged=True, keep=keep, groups=groups)
        return command_verdict(run), run.kept, run.keep_error

    def kill_group(self, pgid: int) -> None:
        kill_group(pgid)

    def rlimits_line(self, limits: ResourceLimits) -> str:
        """The launcher's "AS_BYTES,CPU_SECONDS,FSIZE_BYTES,NPROC" for a run with `limits`."""
        memory, cpu = limits.memory_mb * 1024 * 1024, max(1, math.ceil(limits.cpu_seconds))
        return ",".join(str(v) for v in (memory, cpu, self._max_file_bytes, self._max_processes))

    def _spawn_argv(
        self,
        argv: list[str],
        work: str,
        status_fd: int,
        stage_fd: int | None,
        limits: ResourceLimits,
        keep_fd: int | None = None,
        *,
        harness: bool = False,
        serve: bool = False,
        seccomp_fd: int | None = None,
    ) -> list[str]:
        """bwrap (when isolating), then the launcher, then `argv` (with `harness`: the harness's
        source and its arguments, run by the launcher's child as the RunTests harness's interpreter;
        the rlimits line then comes first on stdin, so the sandbox can be started before its call;
        with `serve`: the harness's source and the control socket's fd, each call bringing its limits)."""
        rlimits = "-" if serve else "stdin" if harness else self.rlimits_line(limits)
        stage = "-" if stage_fd is None else str(stage_fd)
        keep = "-" if keep_fd is None else str(keep_fd)
        # The harness's interpreter is the launcher's: isolated mode with site, unbuffered. Otherwise
        # the launcher needs no site (the code's own interpreter is exec'd).
        flags = ["-B", "-u", "-I"] if harness or serve else ["-I", "-S", "-B"]
        launcher = [sys.executable, *flags, "-c", LAUNCHER_SOURCE, str(status_fd), rlimits]
        mode = "serve" if serve else "harness" if harness else "exec"
        if not self._isolate:  # the host folder itself is the work folder, unbounded
            return [*launcher, "-", "-", "0", "-", mode, *argv]
        bwrap = self._bwrap or "bwrap"
        sandbox = sandbox_argv(
            bwrap,
            self._user,
            self._binds,
            work,
            self._max_disk_bytes,
            self._guard.mark,
            keep=keep_fd is not None,
            serve=serve,
            seccomp_fd=seccomp_fd,
        )
        return [*sandbox, *launcher, self._user, stage, "1", keep, mode, *argv]

    async def _run(
        self,
        argv: list[str],
        work: str,
        limits: ResourceLimits,
        *,
        stdin: bytes | None = None,
        report_pipe: tuple[int, int] | None = None,
        staged: bool = False,
        keep: str | None = None,
        groups: set[int] | None = None,
    ) -> Run:
        """Spawn, wait up to the wall-clock limit, kill the group, collect output. Never raises OSError."""
        started = await self._start(
            argv, work, limits, with_stdin=stdin is not None, report_pipe=report_pipe, staged=staged, keep=keep
        )
        return await self._finish(started, limits, stdin, groups)

    async def _start(
        self,
        argv: list[str],
        work: str,
        limits: ResourceLimits,
        *,
        with_stdin: bool = False,
        report_pipe: tuple[int, int] | None = None,
        staged: bool = False,
        keep: str | None = None,
        harness: bool = False,
        control_fd: int | None = None,
    ) -> Started:
        """Spawn the sandbox and connect its pipes; its stdin (if any) stays open until _finish.
        `control_fd`: a serving RunTests sandbox's end of its control socket (the caller closes it).
        Never raises OSError: a spawn that failed is a Started whose run holds the error."""
        # Isolated, the launcher copies the staged files into the run's tmpfs through this fd.
        stage_fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY) if staged and self._isolate else None
        # Our own pipes rather than asyncio's: Process.wait() would otherwise
        # also wait for every pipe to close, which a stray process can delay.
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "status")}
        if with_stdin:
            pipes["stdin"] = os.pipe()
        if report_pipe is not None:
            pipes["report"] = report_pipe
        child_ends = [w for name, (_, w) in pipes.items() if name != "stdin"]
        if stage_fd is not None:
            child_ends.append(stage_fd)
        keep_fd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY) if keep is not None and self._isolate else None
        if keep_fd is not None:
            child_ends.append(keep_fd)
        if with_stdin:
            child_ends.append(pipes["stdin"][0])
        seccomp_fd = filter_pipe() if self._isolate else None  # bwrap reads it whole before the code runs
        if seccomp_fd is not None:
            child_ends.append(seccomp_fd)
        started = Started(
            work=work,
            parent_ends=[r for name, (r, _) in pipes.items() if name != "stdin"],
            captures=captures(limits.max_output_bytes),
            read=[name for name in pipes if name != "stdin"],
        )
        if with_stdin:
            started.parent_ends.append(pipes["stdin"][1])
        try:
            try:
                if self._closed:
                    raise OSError("the sandbox service is stopping")
                if self._isolate:
                    self._guard.start()
                spawn = asyncio.create_subprocess_exec(
                    *self._spawn_argv(
                        argv,
                        work,
                        pipes["status"][1],
                        stage_fd,
                        limits,
                        keep_fd,
                        harness=harness,
                        serve=control_fd is not None,
                        seccomp_fd=seccomp_fd,
                    ),
                    stdin=pipes["stdin"][0] if with_stdin else asyncio.subprocess.DEVNULL,
                    stdout=pipes["stdout"][1],
                    stderr=pipes["stderr"][1],
                    pass_fds=[
                        pipes["status"][1],
                        *([pipes["report"][1]] if report_pipe else []),
                        *([stage_fd] if stage_fd is not None else []),
                        *([keep_fd] if keep_fd is not None else []),
                        *([control_fd] if control_fd is not None else []),
                        *([seccomp_fd] if seccomp_fd is not None else []),
                    ],
                    # Isolated, bwrap chdirs into the run's tmpfs (a RunTests run has no host folder).
                    cwd="/" if self._isolate else work,
                    env=sandbox_environment(work),
                    start_new_session=True,  # its own process group: one killpg reaches everything it starts
                )
                proc = await uncancelled(spawn)
            except OSError as exc:
                started.run.error = f"cannot spawn the sandbox process: {exc}"
                started.close_fds()
                return started
            finally:
                for fd in child_ends:
                    os.close(fd)
            started.proc = proc
            self._live_groups.add(proc.pid)
            if self._closed:  # close() ran while it was spawning: it missed this group
                kill_group(proc.pid)
            await started.connect(pipes)
        except BaseException:
            await self.discard(started)
            raise
        return started

    async def _start_harness(self) -> Started:
        """A RunTests sandbox up to the harness, waiting for its call's stdin (warm_pool.py).
        OSError when its work folder cannot be made."""
        # Isolated, nothing is staged: the work folder is the sandbox's own tmpfs, with no host folder.
        work = self._folders.unmade() if self._isolate else await self._folders.make_off_loop()
        try:
            report_read, report_write = os.pipe()
            # The launcher's child runs the harness itself: one interpreter start per task. The
            # limits given here only size the output captures until the call sets its own.
            argv = [HARNESS_SOURCE, str(report_write)]
            return await self._start(
                argv, work, PROBE_LIMITS, with_stdin=True, report_pipe=(report_read, report_write), harness=True
            )
        except BaseException:
            await asyncio.to_thread(remove_tree, work)
            raise

    async def _start_worker(self) -> Worker:
        """A serving RunTests sandbox (as root, isolated), waiting on its control socket for calls.
        OSError when it could not be spawned."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [HARNESS_SOURCE, str(theirs.fileno())]
            started = await self._start(argv, self._folders.unmade(), PROBE_LIMITS, control_fd=theirs.fileno())
        finally:
            theirs.close()
        if started.proc is None:
            ours.close()
            raise OSError(started.run.error)
        return Worker(started, ours)

    async def _discard_worker(self, worker: Worker) -> None:
        worker.close_control()
        await self.discard(worker.started)

    async def _discard_harness(self, started: Started) -> None:
        await self.discard(started)
        if not self._isolate:
            await asyncio.to_thread(remove_tree, started.work)

    async def discard(self, started: Started) -> None:
        """A started sandbox that will run nothing: its group killed, its pipes closed (not its folder)."""
        if started.proc is not None:
            kill_group(started.proc.pid)
            self._live_groups.discard(started.proc.pid)
            await started.proc.wait()
        started.close_fds()

    async def _finish(
        self, started: Started, limits: ResourceLimits, stdin: bytes | None, groups: set[int] | None = None
    ) -> Run:
        """Hand `stdin` over, wait up to the wall-clock limit (from now), kill the group, collect output."""
        run, proc, captures = started.run, started.proc, started.captures
        if proc is None:
            return run  # the spawn failed, saying why
        start = time.monotonic()
        try:
            try:
                if groups is not None:
                    groups.add(proc.pid)
                for name in ("stdout", "stderr"):  # set now: a warm sandbox was started before its call
                    captures[name].cap = limits.max_output_bytes
                if started.stdin is not None:
                    started.stdin.write(stdin or b"")
                    started.stdin.close()  # flushes what is buffered, then closes: the harness sees EOF
                try:
                    run.exit_code = await asyncio.wait_for(proc.wait(), limits.timeout_seconds)
                except TimeoutError:
                    run.timed_out = True
            finally:
                # Always, not only on timeout: whatever the code left running dies with it.
                kill_group(proc.pid)
                self._live_groups.discard(proc.pid)
                if groups is not None:
                    groups.discard(proc.pid)
            run.exit_code = await proc.wait()
            run.duration = time.monotonic() - start
            readers = [captures[name].closed for name in started.read]
            await asyncio.wait(readers, timeout=DRAIN_GRACE_SECONDS)
        finally:
            started.close_fds()
        started.collect()
        return run
