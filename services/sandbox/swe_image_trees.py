"""Start trees taken from a row's image (SWE-smith, R2E-Gym): image + row -> checkout + held-out test patch.

    resolved image ──create (never started)──> get_archive(repo_dir), get_archive(each held_out_from folder)
        ──untar (no path, and no hard link, outside the folder)──> tree (the image's .git dropped)
        ──git apply start_patch (SWE-smith's bug)──> held_out paths (and their bytecode) moved out of the tree
        ──git init; add --all; commit-tree (no parent); HEAD detached──> checkout, cached per (image id, instance)
    held-out files ──new-file diffs──> test patch (the driver applies it after the solution, before the tests)

Guarantees: the checkout's one commit holds the start tree and nothing held out (no object of a
held-out file is ever written to it), and its working tree is the image's folder as the image built
it (environment and build outputs included; what the repository's .gitignore ignores, and the
format's `untracked` paths such as R2E-Gym's /testbed/.venv, stay out of the commit and so out of a
session's diff); the start patch must apply whole, else
ImageTreeError naming the instance; a held-out file that is not UTF-8 text is refused the same way
(a test patch is text). Host-side git gets only paths of the tree and fixed arguments. Nothing here
follows a link of the image's out of the tree: a hard link to a file outside it is refused at untar, and
a held-out path through a symbolic link is an ImageTreeError.

Cost, not covered: the whole folder is copied into each run's work folder, as a checkout is; an
image whose repository folder holds a large environment (R2E-Gym's /testbed/.venv) copies it too.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.swe_formats import PrebuiltEnv

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "dockyard",
    "GIT_AUTHOR_EMAIL": "dockyard@localhost",
    "GIT_COMMITTER_NAME": "dockyard",
    "GIT_COMMITTER_EMAIL": "dockyard@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


class ImageTreeError(RuntimeError):
    """A start tree that cannot be made from an image; the message names the instance and the step."""


@dataclass(frozen=True)
class ImageTree:
    checkout: Path  # a repository whose one commit (and working tree) is the start state
    test_patch: str  # the held-out files, as new-file diffs against that commit


def _git(tree: Path, *args: str, stdin: bytes | None = None) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tree), **_GIT_ENV}
    done = subprocess.run(["git", "-C", str(tree), *args], input=stdin, capture_output=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"git {args[0]}: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout.decode()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _image_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """The "tar" filter (no name outside `dest`), and no hard link to a file outside it: a hard link is
    made on this host, so one naming /etc/passwd would put the host's file in every session's copy.
    Symbolic links (a venv's interpreter) are kept as they are: sessions copy them as links, which resolve
    inside the container, and the host side below never follows one."""
    member = tarfile.tar_filter(member, dest)
    if member.islnk():
        root = os.path.realpath(dest)
        target = os.path.realpath(os.path.join(dest, member.linkname))
        if os.path.isabs(member.linkname) or os.path.commonpath([target, root]) != root:
            raise tarfile.LinkOutsideDestinationError(member, target)
    return member


def _copy_out(client, image: str, folder: str, dest: Path) -> Path:
    """`folder` of `image` extracted under `dest`; returns where it landed (never a link). No container is started."""
    container = client.containers.create(image, command=["true"])
    try:
        stream, _ = container.get_archive(folder)
        with tempfile.TemporaryFile(dir=dest) as archive:
            for chunk in stream:
                archive.write(chunk)
            archive.seek(0)
            with tarfile.open(fileobj=archive) as tar:
                tar.extractall(dest, filter=_image_member)
    finally:
        container.remove(force=True)
    landed = dest / Path(folder).name
    if landed.is_symlink():
        raise ValueError(f"{folder} is a symbolic link in the image")
    return landed


def _within(tree: Path, rel: str) -> Path:
    """`tree / rel`, refused when a folder on the way is a symbolic link (the host would follow it out)."""
    path = tree
    for part in Path(rel).parts[:-1]:
        path = path / part
        if path.is_symlink():
            raise ValueError(f"{rel} passes through the symbolic link {path.relative_to(tree)}")
    return tree / rel


def _drop_caches(tree: Path, rel: str) -> None:
    """What would give a held-out test away beside the file: its bytecode, and pytest's cache."""
    path = _within(tree, rel)
    cache = path.parent / "__pycache__"
    if cache.is_dir() and not cache.is_symlink():
        for compiled in cache.glob(f"{path.stem}.*.pyc"):
            compiled.unlink()
    _remove(tree / ".pytest_cache")


def new_file_diff(path: str, data: bytes, executable: bool) -> str:
    """The git diff that creates `path` holding `data`; ValueError when it is not UTF-8 text."""
    text = data.decode("utf-8")  # UnicodeDecodeError is a ValueError
    head = f"diff --git a/{path} b/{path}\nnew file mode {'100755' if executable else '100644'}\n"
    if not text:
        return head
    lines = text.splitlines(keepends=True)
    body = "".join("+" + line for line in lines)
    if not text.endswith("\n"):
        body += "\n\\ No newline at end of file\n"
    return f"{head}--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


def _held_out_patch(root: Path, prefix: str) -> str:
    """New-file diffs of every file under `root` (a file or a folder), named `prefix/<relative path>`."""
    files = [root] if not root.is_dir() else sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())
    parts = []
    for path in files:
        rel = prefix if path == root else f"{prefix}/{path.relative_to(root).as_posix()}"
        if "__pycache__" in rel.split("/") or rel.endswith(".pyc"):
            continue  # R2E-Gym deletes these before its runs
        if path.is_symlink():
            raise ValueError(f"{rel} is a symbolic link")
        parts.append(new_file_diff(rel, path.read_bytes(), os.access(path, os.X_OK)))
    return "".join(parts)


def build_tree(client, image: str, instance_id: str, env: PrebuiltEnv, target: Path) -> str:
    """Makes the start checkout of `instance_id` at `target` (absent); returns its held-out test patch."""
    with tempfile.TemporaryDirectory(prefix="image-tree-", dir=target.parent) as scratch:
        step = f"copy {env.repo_dir} out of {image}"
        try:
            tree = _copy_out(client, image, env.repo_dir, Path(scratch))
            _remove(tree / ".git")  # the image's history: SWE-smith's mirror, R2E-Gym's upstream clone
            _git(tree, "init", "--quiet")
            if env.start_patch.strip():
                step = "apply the row's patch to the image's repository"
                _git(tree, "apply", "--whitespace=nowarn", "-", stdin=env.start_patch.encode())
            step = "hold out the tests"
            patches, away = [], Path(scratch, "held-out")
            away.mkdir()
            given_back = {rel for _, rel in env.held_out_from}
            for n, rel in enumerate(env.held_out):
                path = _within(tree, rel)
                _drop_caches(tree, rel)
                if rel in given_back or path.is_symlink():  # R2E-Gym's r2e_tests: the image's folder, below
                    _remove(path)
                elif os.path.lexists(path):
                    os.replace(path, away / str(n))
                    patches.append(_held_out_patch(away / str(n), rel))
            for folder, rel in env.held_out_from:
                step = f"copy the held-out {folder} out of {image}"
                landed = _copy_out(client, image, folder, Path(tempfile.mkdtemp(dir=away)))
                patches.append(_held_out_patch(landed, rel))
            step = "commit the start tree"
            # The environment stays in the tree for the tests, out of the commit and of a session's diff.
            (tree / ".git" / "info").mkdir(exist_ok=True)
            (tree / ".git" / "info" / "exclude").write_text("".join(f"/{p}\n" for p in env.untracked))
            _git(tree, "add", "--all")
            commit = _git(tree, "commit-tree", _git(tree, "write-tree").strip(), "-m", "start").strip()
            _git(tree, "update-ref", "--no-deref", "HEAD", commit)
            _git(tree, "read-tree", "HEAD")
        except Exception as exc:
            raise ImageTreeError(f"instance {instance_id!r}: cannot {step}: {exc}") from None
        os.replace(tree, target)
    return "".join(patches)


class ImageTrees:
    """Start trees of image-started rows, made once per (image id, instance) and kept until close."""

    def __init__(self, client, root: str | None = None, *, registry: str = "", auth_file: str | None = None) -> None:
        self._client = client
        self._parent = root
        self._pull = {"registry": registry, "auth_file": auth_file}
        self._root: Path | None = None
        self._locks: dict[Path, asyncio.Lock] = {}
        self._patches: dict[Path, str] = {}

    async def for_instance(self, instance_id: str, env: PrebuiltEnv) -> ImageTree:
        """The start tree of a row's image, found locally or pulled (swe_prebuilt.resolve) first."""
        from services.sandbox.swe_prebuilt import resolve

        local = await asyncio.to_thread(resolve, self._client, instance_id, env.image, **self._pull)
        return await self.get(local, instance_id, env)

    async def get(self, image: str, instance_id: str, env: PrebuiltEnv) -> ImageTree:
        """The start tree of `instance_id` in the resolved `image` (a local name)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="dockyard-swe-image-trees-", dir=self._parent))
        image_id = await asyncio.to_thread(lambda: self._client.images.get(image).id)
        key = hashlib.sha256(f"{image_id}\0{instance_id}\0{env!r}".encode()).hexdigest()[:24]
        target = self._root / key
        async with self._locks.setdefault(target, asyncio.Lock()):
            if target not in self._patches:
                patch = await asyncio.to_thread(build_tree, self._client, image, instance_id, env, target)
                self._patches[target] = patch
        return ImageTree(target, self._patches[target])

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
