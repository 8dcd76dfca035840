"""The bubblewrap command line of the local backend: which namespaces, which host paths, which work folder.

    sandbox_argv(bwrap, user, binds, work, disk bytes, mark, keep=, serve=, seccomp_fd=)
        --> bwrap: net, pid, ipc, uts, cgroup and mount namespaces (+ a user namespace when not root)
            + the seccomp filter read from seccomp_fd (seccomp.py: no kernel keyring syscalls)
            + `mark` in its command line (run_guard.py finds the runs of a dead service by it)
            + read_only_binds(): SYSTEM_PATHS and the interpreter's prefixes, read-only, at their paths
              (a prefix reached through a symlink also at that path, as a link to the real one)
            + the work folder: a tmpfs of the disk limit at the host folder's path, mode 0700
            + "--"  (the launcher and the command follow)

Guarantees: bwrap, the namespace's init and everything the code starts stay in the process group
the service made for the run (no --new-session), so the service's one killpg reaches the run at
every stage of bwrap's setup; nothing of the host is shown but SYSTEM_PATHS and the interpreter's
prefixes, all read-only; the folders leading to them are searchable (0755) by the
sandbox uid; as root only CAP_SETUID, CAP_SETGID and CAP_CHOWN are kept (for the
launcher, which drops them with the uid; a session's or a serving sandbox's launcher also keeps
CAP_KILL and CAP_DAC_OVERRIDE, to clear up after the code), otherwise every capability is dropped
inside a user namespace that cannot nest another.
"""

from __future__ import annotations

import os
import sys
from pathlib import PurePosixPath

# Namespaces (network, pid, ipc, uts, cgroup; mount always), a fresh /proc of the pid namespace, a
# minimal /dev. When the launcher (pid 2) ends, the namespace's init ends and the kernel kills
# every process left in it; --die-with-parent does the same when bwrap dies, once set up.
# No --new-session: its setsid would take the namespace's init out of the run's process group
# before the init sets its own parent-death signal, and bwrap killed in between (by the service's
# killpg) would leave that init running, orphaned, ignoring SIGTERM as a namespace's init does.
# The service starts bwrap in a session of its own (start_new_session), so the sandbox has no
# controlling terminal to inject input into, which is what --new-session is for.
BWRAP_FLAGS = (
    "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    "--hostname", "sandbox", "--die-with-parent", "--proc", "/proc", "--dev", "/dev",
)  # fmt: skip
# As root the launcher keeps only what it needs to stage the work folder and drop to the sandbox
# uid; the code itself then has no capability. A non-root service needs a user namespace.
BWRAP_ROOT_FLAGS = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN")
BWRAP_USER_FLAGS = ("--unshare-user", "--disable-userns", "--cap-drop", "ALL")
# What the interpreter and the usual tools need, shown read-only; nothing else of the host.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/alternatives")


def read_only_binds() -> list[str]:
    """bwrap arguments showing SYSTEM_PATHS and this interpreter's prefixes, read-only, at their paths."""
    args: list[str] = []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += [*searchable_parents(path), "--ro-bind", path, path]
    given = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    for prefix in sorted({os.path.realpath(p) for p in given}):
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            args += [*searchable_parents(prefix), "--ro-bind", prefix, prefix]
    # A prefix reached through a symlink (a virtualenv linked from elsewhere): the interpreter runs
    # by that path (sys.executable), so the sandbox shows it too, as a link to the bound real folder.
    for prefix in sorted(p for p in given if os.path.realpath(p) != p):
        args += [*searchable_parents(prefix), "--symlink", os.path.realpath(prefix), prefix]
    return args


def searchable_parents(path: str) -> list[str]:
    """bwrap arguments making `path`'s folders 0755: bwrap would make them 0700, closed to the sandbox uid."""
    args: list[str] = []
    for parent in reversed(PurePosixPath(path).parents[:-1]):  # outermost first, without "/"
        args += ["--perms", "0755", "--dir", str(parent)]
    return args


# Session runs, as root: the launcher also copies the work folder out whatever modes the code left
# (DAC_OVERRIDE) after killing what the code left running (KILL); the code's uid drop clears both. A
# serving sandbox's launcher (RunTests calls one after another) needs the same to reset it between calls,
# and its IPC namespace's message queues shown, to find any a call left.
BWRAP_KEEP_FLAGS = ("--cap-add", "CAP_DAC_OVERRIDE", "--cap-add", "CAP_KILL")
BWRAP_SERVE_FLAGS = (*BWRAP_KEEP_FLAGS, "--mqueue", "/dev/mqueue")


def sandbox_argv(
    bwrap: str,
    user: str,
    binds: list[str],
    work: str,
    max_disk_bytes: int,
    mark: str,
    *,
    keep: bool = False,
    serve: bool = False,
    seccomp_fd: int | None = None,
) -> list[str]:
    """bwrap and its arguments up to "--"; `user` "-" means a non-root service (a user namespace);
    `mark`: a variable name unique to the service, carried in bwrap's command line (the code never
    sees it); `keep`: a session run, whose launcher copies the work folder out afterwards; `serve`:
    a RunTests sandbox serving calls one after another (as root only); `seccomp_fd`: an fd holding the
    seccomp filter (seccomp.py) that bwrap installs on the sandbox."""
    if user == "-":
        caps: tuple[str, ...] = BWRAP_USER_FLAGS
    else:
        caps = BWRAP_ROOT_FLAGS + (BWRAP_SERVE_FLAGS if serve else BWRAP_KEEP_FLAGS if keep else ())
    return [
        bwrap,
        *BWRAP_FLAGS,
        # Unsetting a variable nothing sets changes nothing: the argument is there for its name.
        *("--unsetenv", mark),
        *caps,
        *(("--seccomp", str(seccomp_fd)) if seccomp_fd is not None else ()),
        *binds,
        # The work folder: a tmpfs of the disk limit at the host folder's path, private to the run.
        *searchable_parents(work),
        *("--perms", "0700", "--size", str(max_disk_bytes), "--tmpfs", work, "--chdir", work),
        "--",
    ]
