"""Code that runs inside the sandbox process, before (and around) the untrusted code.

    service --fork/exec--> [bwrap] LAUNCHER (python -I -S; RunTests: python -B -u -I): stage, fork, wait
                                 child: setrlimit(...), drop to the sandbox uid, then
                                   mode "exec": exec argv
                                   mode "harness" (RunTests): run HARNESS in this same process
                                 status pipe: "ready", "error <why>", "disk-full", "exit <code>"
                                 v
                           HARNESS (RunTests only; the docker backend runs it as python -I)
      stdin:  ["<rlimits>\\n" (read by the launcher)] "<nonce>\\n" + {"program", "tests"}
                                                     read in full before any untrusted code runs
      report fd (inherited pipe, not stdout):
              "<nonce> ready\\n"                     the harness started
              "<nonce> result <one 0/1 per test>\\n"   every test ran; then os._exit(0)

Both are source strings run with `-c`, so nothing on the host's import path
is needed inside the sandbox.

Why the harness runs inside the launcher's child rather than by an exec of a second
interpreter: an interpreter start with its site module is most of a small task's cost, and the
launcher is one already (and a waiting one has the harness compiled: the local backend starts
RunTests sandboxes ahead of their calls). The child is as fresh as an exec'd harness where it
matters: a forked child of a launcher that ran nothing untrusted, its own rlimits and uid, the
launcher's status and work-folder fds closed before the harness runs; the launcher's variables
it can see name only the limits and the uid it was given. (As root, the uid drop without an exec leaves the
child non-dumpable: the code's own /proc entries belong to root; the code still reads its own.)

What the report protects against: a program that prints a pass report on
stdout or stderr (the report never goes there), one that writes to the report
fd without knowing the per-run nonce (such lines are ignored), one that exits
early (os._exit, sys.exit, a crash, closing the fd: no result line, so every
test counts as failed), one that raises SystemExit or KeyboardInterrupt from a
test (caught: that test fails), and monkeypatching of os.write, exec, compile
or json after start (the harness bound them before the program ran).

What it does not protect against: the program runs in the harness's own
process, so code that deliberately introspects it (gc.get_objects, frames,
/proc/self/mem) can recover the nonce and forge a result, and a program may
return objects that compare equal to anything. Neither backend closes those
(the docker backend runs this same harness): that would take running each
test out of process.
"""

from __future__ import annotations

# argv after -c: status_fd, "AS_BYTES,CPU_SECONDS,FSIZE_BYTES,NPROC" or "stdin" (that line first
# on stdin, read once the sandbox is set up, before the fork) or "-" (serve: each call's own), "UID:GID"
# or "-", stage_fd or "-", disk_bounded ("1"/"0"), keep_fd or "-", mode ("exec" / "harness" / "serve"),
# then exec: the command...; harness: HARNESS_SOURCE and its own argv (report_fd); serve: HARNESS_SOURCE
# and the control socket's fd.
# Status lines: "ready" (the sandbox is up), "error <why>" (the command could not run),
# "disk-full" (the work folder was full when the command ended), "kept" / "keep-error <why>"
# (sessions: the work folder copied out to keep_fd once every process of the run was killed),
# "exit <code>" (negative: signal); serve, on each call's own status pipe: "ready", "error", "disk-full",
# "exit", then "recycle" when the sandbox is as it was before the call, or "retire <why>" (the launcher
# then ends, and the namespace with it).
LAUNCHER_SOURCE = r"""
import os, resource, sys
status_fd = int(sys.argv[1])

def status(line, fd=status_fd):
    os.write(fd, line.encode() + b"\n")

status("ready")
user, stage, disk_bounded, keep = sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6]
run_mode, argv = sys.argv[7], sys.argv[8:]
if keep != "-":
    os.set_inheritable(int(keep), False)  # the code never gets the host folder's fd
work_fd = os.open(".", os.O_RDONLY)  # before the chown: root here has no CAP_DAC_OVERRIDE
if user == "-":  # the code keeps this uid: make this process one it can neither ptrace nor read fds of
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0

def copy_entry(src, dst):  # a fifo is copied as a fifo (as a session's on docker stays one); never read
    mode = os.lstat(src).st_mode
    if stat.S_ISFIFO(mode):
        os.mkfifo(dst, stat.S_IMODE(mode))
    else:
        shutil.copy2(src, dst)

if stage != "-" or keep != "-" or run_mode == "serve":  # only then: a RunTests run copies nothing
    import shutil, stat
try:
    if stage != "-":  # the service's staged files, by fd: no host path is mounted in here
        shutil.copytree(f"/proc/self/fd/{stage}", ".", symlinks=True, dirs_exist_ok=True, copy_function=copy_entry)
        os.close(int(stage))
    if user != "-":
        uid, gid = (int(v) for v in user.split(":"))
        # Deepest first: once a folder is the sandbox uid's (0700), root here can no longer enter it.
        for root, dirs, names in os.walk(".", topdown=False):
            for name in dirs + names:
                os.lchown(os.path.join(root, name), uid, gid)
        os.lchown(".", uid, gid)
except BaseException as exc:
    status(f"error cannot stage the work folder: {type(exc).__name__}: {exc}")
    os._exit(127)
os.environ.pop("PWD", None)  # bwrap's, not the service's environment
# RunTests: the limits are its call's, first on stdin (the sandbox may be started before the call);
# the rest of stdin is the harness's, read by the child through the same buffered sys.stdin.
if run_mode in ("harness", "serve"):  # while the call has not come: the harness compiled, its json imported
    import json
    harness_code = compile(argv[0], "<harness>", "exec")

def limit_and_drop(limits):
    memory, cpu, fsize, nproc = (int(v) for v in limits.split(","))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    if user != "-":  # after the rlimits, so the code cannot raise them again; clears every capability
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if nproc > 0:
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        except (ValueError, OSError):
            pass  # best effort: the service's own hard limit may be lower

def run_harness(harness_argv, launcher_fds):
    # The harness, in this process: nothing of the launcher's it could use is left open to it.
    try:
        for fd in launcher_fds:
            os.close(fd)
        sys.argv = ["-c", *harness_argv]
        exec(harness_code, {"__name__": "__main__", "__builtins__": __builtins__})
    finally:
        os._exit(1)  # the harness ends with its own os._exit(0); never back into the launcher

def reset():
    # Back to how the call found the sandbox, or why not: CAP_KILL reaches every process but the
    # namespace's init and this one (the killed ones' zombies count until init reaps them);
    # CAP_DAC_OVERRIDE empties the work folder whatever modes the code set.
    import time
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, 9)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            return "processes outlived the call"
        time.sleep(0.0005)
    try:
        for name in os.listdir("."):
            if os.path.isdir(name) and not os.path.islink(name):
                shutil.rmtree(name)
            else:
                os.unlink(name)
        os.chown(".", 0, 0)  # root's again: without CAP_FOWNER only the owner may change its mode
        for attribute in os.listxattr("."):
            os.removexattr(".", attribute)
        os.chmod(".", 0o700)
        os.chown(".", uid, gid)
        if os.listdir("."):
            return "the work folder could not be emptied"
        for kind in ("shm", "sem", "msg"):  # this IPC namespace's System V objects
            with open(f"/proc/sysvipc/{kind}") as table:
                if len(table.read().splitlines()) > 1:
                    return f"System V {kind} objects were left"
        if os.listdir("/dev/mqueue"):  # and its POSIX message queues
            return "message queues were left"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""

if run_mode == "serve":  # RunTests calls one after another: a fresh forked child each, reset between
    import socket
    if user == "-":  # the code would share this process's uid: it could reach the next call through it
        status("error serving calls needs a uid to drop to")
        os._exit(127)
    control = socket.socket(fileno=int(argv[1]))
    while True:
        try:
            limits, fds, _, _ = socket.recv_fds(control, 4096, 5)
        except OSError:
            os._exit(0)
        if not limits or len(fds) != 5:  # the service closed its end (or sent no call): done
            os._exit(0)
        call_in, call_out, call_err, call_status, call_report = fds
        status("ready", call_status)
        pid = os.fork()
        if pid == 0:
            try:
                for source, target in ((call_in, 0), (call_out, 1), (call_err, 2)):
                    os.dup2(source, target)
                limit_and_drop(limits.decode())
            except BaseException as exc:
                status(f"error cannot run the harness: {type(exc).__name__}: {exc}", call_status)
                os._exit(127)
            run_harness(
                [str(call_report)], (call_in, call_out, call_err, call_status, status_fd, work_fd, control.detach())
            )
        for fd in (call_in, call_out, call_err, call_report):
            os.close(fd)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if os.fstatvfs(work_fd).f_bavail == 0:
            status("disk-full", call_status)
        problem = reset()
        status(f"exit {code}", call_status)
        status(f"retire {problem}" if problem else "recycle", call_status)
        os.close(call_status)
        if problem:
            os._exit(0)  # its pid namespace, and whatever the call left in it, ends here

limits = sys.stdin.buffer.readline().decode() if sys.argv[2] == "stdin" else sys.argv[2]
pid = os.fork()
if pid == 0:
    try:
        limit_and_drop(limits)
        if run_mode == "exec":
            os.set_inheritable(status_fd, False)  # closes on a successful exec
            os.execvp(argv[0], argv)
        elif run_mode != "harness":
            raise ValueError(f"unknown launcher mode {run_mode!r}")
    except BaseException as exc:
        status(f"error cannot run {argv[:1] if run_mode == 'exec' else run_mode}: {type(exc).__name__}: {exc}")
        os._exit(127)
    harness_argv = argv[1:]
    del argv
    run_harness(harness_argv, (status_fd, work_fd, *((int(keep),) if keep != "-" else ())))
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
if disk_bounded and os.fstatvfs(work_fd).f_bavail == 0:
    status("disk-full")
if keep != "-":
    try:  # nothing the code left behind may change the folder while it is copied out
        os.kill(-1, 9)
    except OSError:
        pass
    try:
        def special(folder, names):  # sockets, devices: nothing to keep once the run is gone
            kinds = (stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK)
            return [n for n in names if stat.S_IFMT(os.lstat(os.path.join(folder, n)).st_mode) in kinds]

        # Sparse files would come out whole on the host's disk: their sizes must fit the tmpfs.
        sizes = sum(os.lstat(os.path.join(r, n)).st_size for r, _, names in os.walk(".") for n in names)
        room = os.fstatvfs(work_fd).f_blocks * os.fstatvfs(work_fd).f_frsize
        if sizes > room:
            raise OSError(f"its files add up to {sizes} bytes, more than the disk limit (sparse files count whole)")
        shutil.copytree(
            ".", f"/proc/self/fd/{keep}", symlinks=True, dirs_exist_ok=True, ignore=special, copy_function=copy_entry
        )
        status("kept")
    except BaseException as exc:
        status(f"keep-error {type(exc).__name__}: {str(exc)[:500]}")
status(f"exit {code}")
os._exit(0)  # in the sandbox: its pid namespace, and every process the code left, ends here
"""

# argv after -c: report_fd [ready_fd]; the ready line goes to ready_fd when given (the docker
# backend passes stderr: the first bytes there, before any untrusted code could write).
HARNESS_SOURCE = r"""
def _harness():
    import builtins, json, os, sys
    write, exit_, compile_, exec_, dict_, enumerate_ = os.write, os._exit, compile, exec, dict, enumerate

    def print_exc():  # traceback only when a program raises: its import is a small task's cost
        import traceback
        traceback.print_exc()
    report_fd = int(sys.argv[1])
    ready_fd = int(sys.argv[2]) if len(sys.argv) > 2 else report_fd
    os.set_inheritable(report_fd, False)  # programs the code starts do not get it
    nonce = sys.stdin.buffer.readline().strip()

    def report(line, fd=report_fd):
        write(fd, nonce + b" " + line + b"\n")

    report(b"ready", ready_fd)
    payload = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    program, tests = payload["program"], payload["tests"]
    del payload

    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec_(compile_(program, "<program>", "exec"), namespace)
        program_ok = True
    except BaseException:
        try:
            print_exc()
        except BaseException:
            pass
        program_ok = False
    bits = []
    for index, test in enumerate_(tests):
        if not program_ok:
            bits.append(b"0")
            continue
        try:
            # A shallow copy: names a test binds do not leak into the next test.
            exec_(compile_(test, f"<test {index}>", "exec"), dict_(namespace))
            bits.append(b"1")
        except BaseException as exc:
            try:
                sys.__stderr__.write(f"test {index} failed: {type(exc).__name__}: {exc}\n")
            except BaseException:
                pass
            bits.append(b"0")
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    report(b"result " + b"".join(bits))
    exit_(0)  # skip atexit handlers and finalizers the program may have left


_harness()
"""


def parse_kept(data: bytes) -> tuple[bool, str]:
    """The launcher's keep lines (sessions): (work folder copied out, why not)."""
    kept, error = False, ""
    for line in data.decode("utf-8", errors="replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "kept":
            kept = True
        elif word == "keep-error":
            error = rest
    return kept, error


def parse_status(data: bytes) -> tuple[bool, str, bool, int | None]:
    """The launcher's status lines: (sandbox up, error, work folder full, exit code or None)."""
    ready, error, disk_full, exit_code = False, "", False, None
    for line in data.decode("utf-8", errors="replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "ready":
            ready = True
        elif word == "error":
            error = rest
        elif word == "disk-full":
            disk_full = True
        elif word == "exit":
            exit_code = int(rest)
    return ready, error, disk_full, exit_code
