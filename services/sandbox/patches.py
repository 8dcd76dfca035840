"""Checks on a unified diff before anything applies it, and the integrity rule.

    patch text ──inspect_patch──> paths it touches            (PatchRefused: why it may not run)
    paths ──protected_paths(test_patch paths)──> paths a solution may not touch

Guarantees of `inspect_patch`: a patch it accepts is a text diff (no `GIT binary patch`, no
`Binary files ... differ`), of at most MAX_PATCH_BYTES, whose every path (from `diff --git`,
`---`/`+++`, rename and copy headers, with the first component stripped as `-p1` does) is
relative, free of `..` components and NULs, and outside `.git`; it creates no symlink (mode
120000), and every hunk has exactly the lines its `@@ -a,b +c,d @@` header announces. Anything
else raises PatchRefused naming the first problem. It decides nothing about whether the patch
applies: that is `git apply`'s job inside the sandbox.

Integrity: a solution patch may not touch a file that the held-out test patch touches, nor any
test file or test configuration (`is_test_path`): such a patch could rewrite the very tests that
judge it. Its reward is zeroed by `dockyard.algorithms.apply_integrity`.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from pathlib import PurePosixPath

MAX_PATCH_BYTES = 1024 * 1024
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
TEST_DIRS = frozenset({"test", "tests", "testing", "e2e"})
# Files that steer what pytest collects or how it reports (plugins, addopts, conftest hooks).
TEST_CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})


class PatchRefused(ValueError):
    """A patch that must not be applied; the message says why."""


def _unquote(path: str) -> str:
    """git's C-style quoting ("a/sp\\303\\251cial") -> text."""
    if len(path) >= 2 and path[0] == '"' and path[-1] == '"':
        raw = codecs.escape_decode(path[1:-1].encode("utf-8"))[0]
        return raw.decode("utf-8", errors="replace")
    return path


def _strip_component(path: str) -> str:
    # -p1: "a/pkg/x.py" -> "pkg/x.py"; a path with a single component is kept as it is. An
    # absolute path is refused before stripping, whatever -p1 would make of it.
    if path.startswith("/"):
        raise PatchRefused(f"patch path {path!r} is absolute")
    return path.split("/", 1)[1] if "/" in path else path


def _check_path(path: str) -> str:
    if not path or "\x00" in path:
        raise PatchRefused(f"patch names an empty path or one with a NUL: {path!r}")
    posix = PurePosixPath(path)
    if posix.is_absolute():
        raise PatchRefused(f"patch path {path!r} is absolute")
    if ".." in posix.parts:
        raise PatchRefused(f"patch path {path!r} contains '..'")
    if posix.parts and posix.parts[0] == ".git":
        raise PatchRefused(f"patch path {path!r} is inside .git")
    return str(posix)


def _git_header_paths(rest: str) -> list[str]:
    """Paths of a `diff --git a/X b/Y` line (either side may be quoted)."""
    if rest.startswith('"'):
        end = rest.index('"', 1) if '"' in rest[1:] else -1
        while end > 0 and rest[end - 1] == "\\":
            end = rest.find('"', end + 1)
        if end < 0:
            raise PatchRefused(f"malformed diff header: diff --git {rest}")
        first, second = rest[: end + 1], rest[end + 1 :].strip()
    else:
        cut = rest.find(" b/") if " b/" in rest else rest.find(' "')
        if cut < 0:
            raise PatchRefused(f"malformed diff header: diff --git {rest}")
        first, second = rest[:cut], rest[cut + 1 :]
    return [_strip_component(_unquote(first)), _strip_component(_unquote(second))]


def _file_header_path(rest: str) -> str | None:
    """Path of a `--- X` / `+++ X` line; None for /dev/null. A tab starts a timestamp."""
    name = rest.split("\t", 1)[0].rstrip("\r")
    name = _unquote(name) if name.startswith('"') else name.rstrip()
    if name == "/dev/null":
        return None
    return _strip_component(name)


def inspect_patch(text: str) -> list[str]:
    """The sorted paths a patch touches; PatchRefused when it must not be applied."""
    if len(text.encode("utf-8", errors="replace")) > MAX_PATCH_BYTES:
        raise PatchRefused(f"patch is larger than {MAX_PATCH_BYTES} bytes")
    if not text.strip():
        raise PatchRefused("patch is empty")
    paths: set[str] = set()
    hunks = 0
    old_left = new_left = 0
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        if old_left > 0 or new_left > 0:  # inside a hunk: only hunk lines are allowed
            tag = line[:1]
            if tag in (" ", ""):
                old_left, new_left = old_left - 1, new_left - 1
            elif tag == "-":
                old_left -= 1
            elif tag == "+":
                new_left -= 1
            elif tag == "\\":  # "\ No newline at end of file"
                continue
            else:
                raise PatchRefused(f"malformed diff: line {number} ends a hunk early: {line[:80]!r}")
            if old_left < 0 or new_left < 0:
                raise PatchRefused(f"malformed diff: line {number} overruns its hunk's line counts")
            continue
        if line.startswith("\\"):
            continue
        if line.startswith("diff --git "):
            paths.update(_check_path(p) for p in _git_header_paths(line[len("diff --git ") :]))
        elif line.startswith(("--- ", "+++ ")):
            path = _file_header_path(line[4:])
            if path is not None:
                paths.add(_check_path(path))
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            paths.add(_check_path(_unquote(line.split(" ", 2)[2])))
        elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
            raise PatchRefused("binary patches are refused")
        elif line.startswith(("new file mode 120000", "new mode 120000", "deleted file mode 120000")):
            raise PatchRefused("patches that create or change symlinks are refused")
        elif line.startswith("@@"):
            match = _HUNK.match(line)
            if match is None:
                raise PatchRefused(f"malformed diff: bad hunk header at line {number}: {line[:80]!r}")
            old_left = int(match.group(2) if match.group(2) is not None else 1)
            new_left = int(match.group(4) if match.group(4) is not None else 1)
            hunks += 1
    if old_left > 0 or new_left > 0:
        raise PatchRefused("malformed diff: the last hunk is shorter than its header says")
    if not paths:
        raise PatchRefused("malformed diff: no file headers found")
    if hunks == 0 and not any(
        line.startswith(("rename ", "copy ", "deleted file", "new file", "new mode")) for line in lines
    ):
        raise PatchRefused("malformed diff: no hunks found")
    return sorted(paths)


def is_test_path(path: str) -> bool:
    """A test file (test_*.py, *_test.py, tests.py, under a test folder) or pytest configuration."""
    parts = PurePosixPath(path).parts
    if not parts:
        return False
    name = parts[-1]
    return (
        any(part in TEST_DIRS for part in parts[:-1])
        or name in TEST_CONFIG_FILES
        or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py") or name == "tests.py"))
    )


def protected_paths(touched: Iterable[str], test_patch_paths: Iterable[str]) -> list[str]:
    """The paths of `touched` that a solution may not touch (sorted)."""
    held_out = set(test_patch_paths)
    return sorted(p for p in set(touched) if p in held_out or is_test_path(p))
