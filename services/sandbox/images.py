"""Sandbox images, built offline: no registry is ever contacted, image builds run without network.

    debootstrap bookworm (minbase + python3, venv, git, patch) --docker import--> BASE_IMAGE
    BASE_IMAGE + sandbox user + /opt/venv (pytest...) from a wheelhouse -------> SANDBOX_IMAGE
    SANDBOX_IMAGE + a repository's requirements from a wheelhouse ------------> dockyard/env:<content hash>

Every `ensure_*` function is idempotent: it returns at once when an image with
the expected tag (and, for built images, the expected content-hash label)
exists, and builds it otherwise. Only the host side reaches a network: the
Debian mirror for debootstrap and the package index for `pip download` (into a
wheelhouse folder that is reused). `python -m services.sandbox.images` (called
by deploy/images/build.sh) builds the base and the sandbox image.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

BASE_IMAGE = "dockyard/sandbox-base:bookworm"
SANDBOX_IMAGE = "dockyard/sandbox:latest"
ENV_IMAGE_REPOSITORY = "dockyard/env"
HASH_LABEL = "dockyard.content-hash"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "git", "ca-certificates", "patch")
SANDBOX_CONTEXT = Path(__file__).resolve().parents[2] / "deploy" / "images" / "sandbox"
IMAGE_PYTHON = "3.11"  # bookworm's python3: wheels are downloaded for it, whatever the host runs
# Every platform tag bookworm's glibc 2.36 runs (pip takes --platform tags literally, it does not widen them).
IMAGE_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(36, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
DEFAULT_WHEELHOUSE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dockyard" / "wheelhouse"

# An environment image adds packages to the sandbox image's venv and stays non-root.
ENV_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
USER root
COPY requirements.txt /tmp/build/requirements.txt
COPY wheels /tmp/build/wheels
RUN test -x /opt/venv/bin/python || python3 -m venv /opt/venv; \\
    /opt/venv/bin/pip install --no-index --no-cache-dir --find-links /tmp/build/wheels \\
      -r /tmp/build/requirements.txt && rm -rf /tmp/build
USER 1000:1000
WORKDIR /work
"""

_build_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def is_project_folder(requirement: str) -> bool:
    """A requirement that names a local project folder (built into a wheel here) rather than an index package.
    The config checks the same rule (dockyard/config/verifiers.py): this service's image has no config package."""
    return requirement.startswith(("/", "./", "../"))


def package_error(packages: Sequence[str], project_root: str | None) -> str | None:
    """Why a session may not have `packages` (None: it may). A local project folder is built on this host, its
    build code run here, so it must lie inside `project_root` (DOCKYARD_SANDBOX_PROJECT_ROOT), which the
    deployment fills with projects it trusts; with no root, every folder is refused."""
    for package in packages:
        if not package.strip() or package.strip().startswith("-") or "\n" in package:
            return f"packages: {list(packages)[:8]!r}: each must be a pip requirement"
        if not is_project_folder(package):
            continue
        if project_root is None:
            return (
                f"packages: {package!r} is a local project folder, built on the sandbox host: it is accepted only "
                "inside DOCKYARD_SANDBOX_PROJECT_ROOT, which is unset"
            )
        root = os.path.realpath(project_root)
        if os.path.commonpath([os.path.realpath(package), root]) != root:
            return f"packages: {package!r} is outside DOCKYARD_SANDBOX_PROJECT_ROOT ({project_root})"
    return None


def _lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _build_locks.setdefault(tag, threading.Lock())


def _label(client, tag: str) -> str | None:
    """The image's content-hash label; None when the image does not exist."""
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return (image.labels or {}).get(HASH_LABEL, "")


def ensure_base_image(client, tag: str = BASE_IMAGE, mirror: str = DEBIAN_MIRROR) -> str:
    """`tag` exists, or is made by debootstrap (minbase + BASE_PACKAGES) and `docker import` (needs root)."""
    with _lock(tag):
        if _label(client, tag) is not None:
            return tag
        with tempfile.TemporaryDirectory(prefix="dockyard-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    "bookworm",
                    rootfs,
                    mirror,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (rootfs / cache).glob("*.deb" if "archives" in cache else "*_*"):
                    entry.unlink()
            tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
            tar.stdout.close()
            if tar.wait() != 0:
                raise RuntimeError(f"tar of {rootfs} failed")
        return tag


def download_wheels(requirements: Sequence[str], wheelhouse_dir: str | os.PathLike) -> None:
    """`pip download` binary wheels of `requirements` (and their dependencies) for the image's Python.

    Wheels already in `wheelhouse_dir` are not fetched again. Needs the package index.
    """
    Path(wheelhouse_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        req.write("\n".join(requirements) + "\n")
        req.flush()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:"]
            + ["--python-version", IMAGE_PYTHON, "--implementation", "cp"]
            + [arg for platform in IMAGE_PLATFORMS for arg in ("--platform", platform)]
            + ["--dest", str(wheelhouse_dir), "-r", req.name],
            check=True,
        )


def _build(
    client, context: Path, tag: str, base_image: str, content_hash: str, args: dict[str, str] | None = None
) -> None:
    client.images.build(
        path=str(context),
        tag=tag,
        buildargs={"BASE_IMAGE": base_image, **(args or {})},
        labels={HASH_LABEL: content_hash},
        network_mode="none",
        rm=True,
        forcerm=True,
        pull=False,
    )


def _context(tmp: Path, dockerfile: str, requirements: Sequence[str], wheelhouse_dir: Path) -> Path:
    """A build context holding the Dockerfile, requirements.txt and a copy of the wheelhouse."""
    (tmp / "Dockerfile").write_text(dockerfile)
    (tmp / "requirements.txt").write_text("\n".join(requirements) + "\n")
    shutil.copytree(wheelhouse_dir, tmp / "wheels")
    return tmp


def _requirements_file(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def ensure_sandbox_image(
    client,
    tag: str = SANDBOX_IMAGE,
    base_image: str = BASE_IMAGE,
    wheelhouse_dir: str | os.PathLike = DEFAULT_WHEELHOUSE,
) -> str:
    """`tag` built from deploy/images/sandbox on `base_image`; rebuilt when its Dockerfile,
    requirements or base change (content-hash label), otherwise left alone."""
    dockerfile = (SANDBOX_CONTEXT / "Dockerfile").read_text()
    requirements = _requirements_file(SANDBOX_CONTEXT / "requirements.txt")
    base_id = client.images.get(base_image).id
    content_hash = hashlib.sha256("\0".join([base_id, dockerfile, *requirements]).encode()).hexdigest()
    with _lock(tag):
        if _label(client, tag) == content_hash:
            return tag
        wheels = Path(wheelhouse_dir) / "sandbox"
        download_wheels(requirements, wheels)
        with tempfile.TemporaryDirectory(prefix="dockyard-build-") as tmp:
            _build(client, _context(Path(tmp), dockerfile, requirements, wheels), tag, base_image, content_hash)
        return tag


# Build outputs, caches, history and environments: never a project's input, and costly to read at each open.
SKIPPED_PARTS = frozenset({"__pycache__", "build", "dist", ".git", ".venv"})


def project_digest(folder: str | os.PathLike) -> str:
    """A hash of a project folder's files (build outputs and caches left out)."""
    digest = hashlib.sha256()
    root = Path(folder)
    for here, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_PARTS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(here, name)
            if path.is_file():
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _identity(requirement: str) -> str:
    """What the image tag hashes of a requirement: the string, and a local folder's contents."""
    return f"{requirement}@{project_digest(requirement)}" if is_project_folder(requirement) else requirement


def build_project_wheels(folders: Sequence[str], wheelhouse_dir: Path) -> list[str]:
    """Each local project folder built into a wheel in `wheelhouse_dir` (from a copy, so the folder gets no
    build output); their distribution names, which the image's requirements then name."""
    names = []
    for folder in folders:
        with tempfile.TemporaryDirectory(prefix="dockyard-project-") as tmp:
            source, out = Path(tmp) / "src", Path(tmp) / "out"
            shutil.copytree(folder, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps"]
                + ["--wheel-dir", str(out), str(source)],
                check=True,
            )
            [wheel] = out.glob("*.whl")
            shutil.copy2(wheel, wheelhouse_dir / wheel.name)
            names.append(wheel.name.split("-", 1)[0])
    return names


def env_image_tag(client, base_image: str, requirements: Sequence[str]) -> str:
    """The tag ensure_env_image gives these inputs: a hash of the base image id, the sorted
    requirements (a local project folder with its contents) and the recipe."""
    base_id = client.images.get(base_image).id
    parts = [base_id, ENV_DOCKERFILE, *sorted({_identity(r.strip()) for r in requirements if r.strip()})]
    return f"{ENV_IMAGE_REPOSITORY}:{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:20]}"


def ensure_env_image(
    client,
    base_image: str,
    requirements: Sequence[str],
    wheelhouse_dir: str | os.PathLike = DEFAULT_WHEELHOUSE,
    *,
    on_build: Callable[[str], None] | None = None,
) -> str:
    """A per-repository environment image: `base_image` plus `requirements` in /opt/venv. Returns its tag.

    - `client`: a docker.DockerClient. `base_image`: normally SANDBOX_IMAGE (it must exist; any
      Debian-like image with python3 works, /opt/venv is made when missing).
    - `requirements`: pip requirement strings ("six==1.16.0", "attrs>=23"); order and duplicates
      do not matter. Pin them: the tag hashes the strings, not what they resolved to. A local project
      folder (`/`, `./` or `../`) is built into a wheel of the wheelhouse (its dependencies downloaded
      like any requirement's), and the tag hashes its files.
    - `wheelhouse_dir`: host folder of wheels. Missing wheels are fetched into it with
      `pip download` (binary wheels for the image's Python 3.11, x86_64) only when the image must be
      built; the build itself runs with `--network none` and installs with `--no-index`.
    - The tag is `dockyard/env:<hash>` of (base image id, sorted requirements, recipe): the same
      inputs give the same tag and the image is built once; later calls return at once.
      Thread-safe: concurrent calls for one tag build it once. `on_build(tag)` is called when this call
      built the image (not when it was there already).
    - The image runs as uid 1000 in /work, like the sandbox image, so DockerBackend can use it as
      `image=`. Raises docker.errors.BuildError or subprocess.CalledProcessError on failure.
    """
    tag = env_image_tag(client, base_image, requirements)
    digest = tag.rsplit(":", 1)[1]
    wanted = sorted({r.strip() for r in requirements if r.strip()})
    with _lock(tag):
        if _label(client, tag) is not None:
            return tag
        wheels = Path(wheelhouse_dir) / "env" / digest
        if wanted:
            download_wheels(wanted, wheels)  # a project folder's dependencies too (pip saves not the folder)
        else:
            wheels.mkdir(parents=True, exist_ok=True)
        folders = [r for r in wanted if is_project_folder(r)]
        installed = [r for r in wanted if not is_project_folder(r)] + build_project_wheels(folders, wheels)
        with tempfile.TemporaryDirectory(prefix="dockyard-build-") as tmp:
            _build(client, _context(Path(tmp), ENV_DOCKERFILE, installed, wheels), tag, base_image, digest)
        if on_build is not None:  # told of a build only, under the lock: a concurrent caller found it built
            on_build(tag)
        return tag


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the sandbox images offline (skips what exists).")
    parser.add_argument("--base-image", default=BASE_IMAGE)
    parser.add_argument("--image", default=os.environ.get("DOCKYARD_SANDBOX_IMAGE", SANDBOX_IMAGE))
    parser.add_argument("--mirror", default=DEBIAN_MIRROR, help="Debian mirror for debootstrap")
    parser.add_argument("--wheelhouse", default=str(DEFAULT_WHEELHOUSE), help="host folder for downloaded wheels")
    args = parser.parse_args(argv)

    import docker

    client = docker.from_env()
    print(f"base image: {ensure_base_image(client, args.base_image, args.mirror)}", flush=True)
    print(f"sandbox image: {ensure_sandbox_image(client, args.image, args.base_image, args.wheelhouse)}", flush=True)


if __name__ == "__main__":
    main()
