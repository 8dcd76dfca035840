"""ReadFile / WriteFile of a session: one file under a work folder, never through a link.

    read_file(root, "a/b.txt", max_bytes)  --> (first max_bytes bytes, whole size)
    write_file(root, "a/b.txt", data)      --> a/ made as needed; b.txt replaced atomically

Guarantees: every folder on the way is opened relative to the one before with
O_NOFOLLOW | O_DIRECTORY, and the file itself with O_NOFOLLOW, so a link the
code planted (to the host's files or anywhere else) is refused, never
followed; only regular files are read (a fifo never blocks the reader); a
write lands in a temporary file first, then replaces the target by rename
(a link at the target is replaced, not followed). Paths reach here checked
(relative, no '..'); FileProblem says what is wrong with the folder's state.

Stdlib only: the local backend imports it and runs it on the host; the docker
backend ships its source into the session's container (`python3 -I -S -c SOURCE
read|write PATH [MAX]`: the file on stdout after a "<size>\\n" line, or read
from stdin; a problem is exit code 3 and "<kind> <message>" on stderr).
"""

import errno
import os
import stat
import sys

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
EXIT_PROBLEM = 3


class FileProblem(Exception):
    """`kind`: "not_found" (no such file), "refused" (a link, not a regular file), "full" (no space)."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def _problem(exc, path):
    if exc.errno == errno.ENOENT:
        return FileProblem("not_found", f"{path!r} does not exist in the session's work folder")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EMLINK):
        return FileProblem("refused", f"{path!r} crosses or names a link or a non-regular file; links are not followed")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return FileProblem("full", f"no room for {path!r}: the session's disk limit (DOCKYARD_SANDBOX_MAX_DISK_MB)")
    return FileProblem("refused", f"{path!r}: {os.strerror(exc.errno or 0)}")


def _parent_fd(root, parts, path, create):
    """An fd of the folder holding parts[-1], walked without following a link."""
    fd = os.open(root, DIR_FLAGS)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            next_fd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        return fd
    except OSError as exc:
        os.close(fd)
        raise _problem(exc, path) from None


def _parts(path):
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise FileProblem("refused", f"{path!r} is not a file path inside the work folder")
    return parts


def read_file(root, path, max_bytes):
    """(the first `max_bytes` bytes of the regular file `path` under `root`, its size)."""
    parts = _parts(path)
    parent = _parent_fd(root, parts, path, create=False)
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError as exc:
        raise _problem(exc, path) from None
    finally:
        os.close(parent)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileProblem("refused", f"{path!r} is not a regular file")
        chunks, left = [], max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), info.st_size
    finally:
        os.close(fd)


def write_file(root, path, data):
    """Replace (or create) the regular file `path` under `root` with `data`; its folders made as needed."""
    parts = _parts(path)
    parent = _parent_fd(root, parts, path, create=True)
    temporary = f".{parts[-1][:200]}.dockyard-{os.getpid()}.tmp"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o644, dir_fd=parent)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(temporary, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
    except OSError as exc:
        try:
            os.unlink(temporary, dir_fd=parent)
        except OSError:
            pass
        raise _problem(exc, path) from None
    finally:
        os.close(parent)


def main(argv):
    op, path = argv[0], argv[1]
    try:
        if op == "read":
            data, size = read_file(".", path, int(argv[2]))
            sys.stdout.buffer.write(b"%d\n" % size + data)
            sys.stdout.buffer.flush()
        else:
            write_file(".", path, sys.stdin.buffer.read())
    except FileProblem as exc:
        sys.stderr.write(f"{exc.kind} {exc}\n")
        sys.exit(EXIT_PROBLEM)


if __name__ == "__main__":
    main(sys.argv[1:])
