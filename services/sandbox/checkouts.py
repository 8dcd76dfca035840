"""Checkouts for SWE scoring: a task set's git mirror + base_commit -> a repository that holds nothing else.

    mirror ──rev-parse base_commit^{tree}, rev-list --objects TREE──> the tree's objects
           ──pack-objects──> new repository (git init) ──commit-tree TREE (no parent)──> detached HEAD
           ──read-tree -u──> work tree; cached per (mirror, commit) under the work root

Guarantees: a checkout's only objects are base_commit's tree and one parentless commit of it, and
its only ref is a detached HEAD, so `git log --all`, `git rev-list --all` and
`git cat-file --batch-all-objects` show nothing more, and no fix, later commit or held-out test of
the mirror (which keeps the upstream branch) can be checked out from it; `git apply` and
`git checkout HEAD -- <path>` work as in a clone. The cache folder is made at the first checkout
and removed by `close`. tree_patch diffs a session's work folder against a checkout without
adding anything to it (new objects go to a scratch folder), so the checkout stays as above;
bytecode and pytest caches that running the code leaves are not part of that diff.
Trusted host-side git: only the mirror and the commit id (validated hex)
reach git's argv.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path


class Checkouts:
    """Working copies of `repo` at `base_commit`, made once from the local mirror and reused."""

    def __init__(self, root: str | None = None) -> None:
        self._parent = root
        self._root: Path | None = None  # made on first use: a service that never scores leaves nothing
        self._locks: dict[Path, asyncio.Lock] = {}

    async def get(self, mirror: Path, base_commit: str) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="dockyard-swe-checkouts-", dir=self._parent))
        target = self._root / mirror.name / base_commit
        lock = self._locks.setdefault(target, asyncio.Lock())
        async with lock:
            if target.is_dir():
                return target
            if not mirror.is_dir():
                raise RuntimeError(f"git mirror {mirror} does not exist")
            staging = Path(tempfile.mkdtemp(prefix="staging-", dir=self._root))
            try:
                await _base_tree_repository(mirror, base_commit, staging / "repo")
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / "repo", target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return target

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


async def _base_tree_repository(mirror: Path, base_commit: str, repo: Path) -> None:
    """`repo` := a fresh repository holding the tree of `base_commit` (from `mirror`) as its one commit."""
    source = ("--git-dir", str(mirror))
    tree = (await _git(*source, "rev-parse", "--verify", "--end-of-options", f"{base_commit}^{{tree}}")).strip()
    objects = await _git(*source, "rev-list", "--objects", "--no-object-names", tree)  # the tree and all in it
    await _git("init", "--quiet", "--template=", str(repo))
    await _git(*source, "pack-objects", "-q", str(repo / ".git" / "objects" / "pack" / "pack"), stdin=objects)
    commit = (await _git("-C", str(repo), "commit-tree", tree, "-m", f"base_commit {base_commit}")).strip()
    await _git("-C", str(repo), "update-ref", "--no-deref", "HEAD", commit)
    await _git("-C", str(repo), "read-tree", "--reset", "-u", "HEAD")


# A fixed identity and date: the one commit is the same whoever makes it.
_GIT_ENV = {
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
    "GIT_AUTHOR_NAME": "dockyard",
    "GIT_AUTHOR_EMAIL": "dockyard@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "dockyard",
    "GIT_COMMITTER_EMAIL": "dockyard@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


# Left out of a session's diff beside what .gitignore says: Python's bytecode and pytest's cache, which
# running the code leaves behind (binary, so a patch holding them would be refused whole).
SESSION_EXCLUDES = "__pycache__/\n*.py[cod]\n.pytest_cache/\n"


async def tree_patch(checkout: Path, tree: str) -> str:
    """`git diff` of the files under `tree` against `checkout`'s one commit: new files included, what
    .gitignore ignores, bytecode caches and every `.git` folder left out, no renames; `checkout` is
    not changed."""
    with tempfile.TemporaryDirectory(prefix="dockyard-tree-diff-") as scratch:
        objects = Path(checkout, ".git", "objects")
        excludes = Path(scratch, "exclude")
        excludes.write_text(SESSION_EXCLUDES)
        env = {
            "GIT_CONFIG_COUNT": "1",
            "GIT_CONFIG_KEY_0": "core.excludesFile",
            "GIT_CONFIG_VALUE_0": str(excludes),
            "GIT_DIR": str(Path(checkout, ".git")),
            "GIT_WORK_TREE": tree,
            "GIT_INDEX_FILE": os.path.join(scratch, "index"),
            "GIT_OBJECT_DIRECTORY": os.path.join(scratch, "objects"),  # the new blobs land here...
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(objects),  # ...the base's are read from there
        }
        os.mkdir(env["GIT_OBJECT_DIRECTORY"])
        await _git("read-tree", "HEAD", env=env)
        await _git("-C", tree, "add", "--all", "--", ".", env=env)
        return await _git(
            "-C", tree, "diff", "--cached", "--no-color", "--no-ext-diff", "--no-renames", "HEAD", env=env
        )


async def _git(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """git's stdout; RuntimeError with its output when it fails."""
    proc = await asyncio.create_subprocess_exec(
        "git",
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **_GIT_ENV, **(env or {})},
    )
    out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}")
    return out.decode()


def missing_objects(mirror: Path, names: list[str]) -> set[str]:
    """Which of `names` (`<commit>^{commit}`, `<commit>:<path>`) `mirror` lacks: one `git cat-file
    --batch-check` for all of them (synchronous: task sets are checked when they load)."""
    import subprocess

    done = subprocess.run(
        ["git", "--git-dir", str(mirror), "cat-file", "--batch-check=%(objectname)"],
        input="".join(f"{name}\n" for name in names),
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **_GIT_ENV},
    )
    if done.returncode != 0:
        raise RuntimeError(f"git cat-file in {mirror} failed: {done.stderr.strip()[-500:]}")
    answers = done.stdout.splitlines()
    return {name for name, answer in zip(names, answers, strict=True) if answer.endswith(" missing")}
