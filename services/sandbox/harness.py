"""Code that runs inside the sandbox process, before (and around) the untrusted code.

    service --fork/exec--> LAUNCHER (python -I -S): setrlimit(...), then exec argv
                                 | exec fails: the reason goes to a close-on-exec status pipe
                                 v
                           HARNESS (python -I, RunTests only)
      stdin:  "<nonce>\\n" + {"program", "tests"}    read in full before any untrusted code runs
      report fd (inherited pipe, not stdout):
              "<nonce> ready\\n"                     the harness started
              "<nonce> result <one 0/1 per test>\\n"   every test ran; then os._exit(0)

Both are source strings run with `-c`, so nothing on the host's import path
is needed inside the sandbox.

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

# argv after -c: status_fd, "AS_BYTES,CPU_SECONDS,FSIZE_BYTES,NPROC", command...
LAUNCHER_SOURCE = r"""
import os, resource, sys
status_fd = int(sys.argv[1])
try:
    memory, cpu, fsize, nproc = (int(v) for v in sys.argv[2].split(","))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU at the soft limit, SIGKILL one second later if it is caught.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    if nproc > 0:
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        except (ValueError, OSError):
            pass  # best effort: the service's own hard limit may be lower
    argv = sys.argv[3:]
    os.set_inheritable(status_fd, False)  # closes on a successful exec: that is the success signal
    os.execvp(argv[0], argv)
except BaseException as exc:
    os.write(status_fd, f"cannot run {sys.argv[3:4]}: {type(exc).__name__}: {exc}".encode())
    os._exit(127)
"""

# argv after -c: report_fd [ready_fd]; the ready line goes to ready_fd when given (the docker
# backend passes stderr: the first bytes there, before any untrusted code could write).
HARNESS_SOURCE = r"""
def _harness():
    import builtins, json, os, sys, traceback
    write, exit_, compile_, exec_, dict_, enumerate_ = os.write, os._exit, compile, exec, dict, enumerate
    print_exc = traceback.print_exc
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
