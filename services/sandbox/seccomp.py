"""The local backend's seccomp filter: the kernel keyring syscalls refused inside every sandbox.

    filter_pipe() --> a pipe's read end holding FILTER --> bwrap --seccomp FD: installed (with
                      no_new_privs) on the sandbox's first process, inherited by everything in it

Why: the kernel keeps one user keyring per uid, shared by every process of that uid on the host,
whatever its namespaces. Every local run executes as the same sandbox uid, so a run that adds a key
(`add_key`) could leave a value that a later run, or a concurrent one in another sandbox, reads back
(`request_key`, `keyctl`): a channel past every namespace. Docker's default seccomp profile refuses
the same three syscalls.

Guarantees: on x86_64, add_key, request_key and keyctl fail with EPERM; so does every syscall of
the x32 ABI and of any other architecture (the i386 `int 0x80` entry would otherwise reach the
same calls under other numbers); every other syscall is allowed. On another host architecture the
filter is not built (None) and the backend says so at start.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# Classic BPF (linux/filter.h, linux/seccomp.h): the program sees struct seccomp_data
# {int nr; u32 arch; u64 instruction_pointer; u64 args[6]}.
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
REFUSED_X86_64 = {"add_key": 248, "request_key": 249, "keyctl": 250}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _program() -> bytes | None:
    if platform.machine() != "x86_64":
        return None
    add_key, request_key, keyctl = REFUSED_X86_64.values()
    # Jump offsets count the instructions skipped: ALLOW is instruction 7, DENY instruction 8.
    return b"".join(
        (
            _op(_LD_W_ABS, 4),  # 0: arch
            _op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=0, jf=6),  # 1: another architecture -> DENY
            _op(_LD_W_ABS, 0),  # 2: syscall number
            _op(_JGE_K, _X32_SYSCALL_BIT, jt=4, jf=0),  # 3: the x32 ABI -> DENY
            _op(_JEQ_K, add_key, jt=3, jf=0),  # 4
            _op(_JEQ_K, request_key, jt=2, jf=0),  # 5
            _op(_JEQ_K, keyctl, jt=1, jf=0),  # 6
            _op(_RET_K, _ALLOW),  # 7
            _op(_RET_K, _DENY),  # 8
        )
    )


FILTER = _program()


def filter_pipe() -> int | None:
    """A pipe's read end holding FILTER, for bwrap's --seccomp (which reads it to the end); None where
    there is no filter for this architecture. The caller closes it after the spawn."""
    if FILTER is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, FILTER)  # 72 bytes: far below a pipe's buffer, never blocks
    finally:
        os.close(write_fd)
    return read_fd
