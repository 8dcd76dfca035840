"""The services' default ports, importable without pydantic so `dockyard --help` answers at once,
and whether a process holds a port.

Guarantees: one port per service, distinct; `default_address` is loopback on that port. `listens_on`
is True only for a TCP socket in LISTEN state on the port among the descriptors of the process or its
descendants.
"""

import os

DEFAULT_PORTS = {
    "coordinator": 50051,
    "trainer": 50052,
    "rollout": 50053,
    "buffer": 50054,
    "sandbox": 50055,
}


def default_address(service: str) -> str:
    return f"127.0.0.1:{DEFAULT_PORTS[service]}"


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` or one of its descendants (a launcher's worker, say) holds a listening TCP
    socket on `port`; None where this cannot be told (no Linux /proc). A health check that answers on a port
    says that something serves there, not that the process just started does: a port drawn free can be
    taken by another server before the process binds it."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    inodes = {inode for p in _family(pid) for inode in _socket_inodes(p)}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                return True
    return False


def _family(pid: int) -> set[int]:
    """`pid` and its descendants, from each process's parent in /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parent = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone since the listing
                continue
            children.setdefault(parent, []).append(int(entry))
    family, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in family:
                family.add(child)
                todo.append(child)
    return family


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes
