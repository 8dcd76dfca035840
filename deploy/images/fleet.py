"""Build one image per service fleet, offline, skipping those already up to date.

    dockyard/coordinator, trainer,       base.txt + torch.txt + agents.txt + endpoint.txt + data_plane.txt
      rollout, endpoint                  (one torch requirement set: one wheelhouse, one venv layer)
    dockyard/buffer                      base.txt + data_plane.txt + buffer.txt    (no torch)
    dockyard/sandbox-service             base.txt + sandbox.txt   (no torch)
    dockyard/redis                       Debian's redis-tools .debs (redis-server)

Each image is deploy/images/<name>/Dockerfile on the debootstrap base image
(services/sandbox/images.py makes it). The host `pip download`s the wheels of
each requirement set into its own wheelhouse folder (reused across builds) and
`apt-get download`s the Redis packages (the host is Debian bookworm, like the
base); builds run with --network none and install with --no-index or dpkg.
Each image carries a content-hash label of its base image id, Dockerfile,
requirements and the source it copies (dockyard/, services/, examples/configs/):
an unchanged image is not rebuilt. The four torch images have identical build
steps up to their last lines and one requirement set (the union of what each of them
imports: the endpoint's HTTP server and agent client are a few MB beside torch), so
Docker's layer cache builds their torch venv once and they share it on disk.

    python deploy/images/fleet.py [--only trainer,buffer] [--tag-suffix :latest]
TORCH_SPEC (default torch==2.13.0, a CPU build) picks the torch of the torch images.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.sandbox.images import (  # noqa: E402
    BASE_IMAGE,
    DEFAULT_WHEELHOUSE,
    _build,
    _label,
    _requirements_file,
)

IMAGES = Path(__file__).resolve().parent
# image name -> requirement files under requirements/ (a service image: wheels + source in /app)
# The torch services' one requirement set. agents.txt: the coordinator's built-in scaffold client; endpoint.txt:
# the policy endpoint's and the dashboard's HTTP server; data_plane.txt: Redis, where experience payloads go
# around the buffer (coordinator and trainer). Each image needs only part of it; sharing it means one venv
# layer for all four (built once: about 2 minutes of a cold build each, otherwise).
TORCH_FLEET = ("base.txt", "torch.txt", "agents.txt", "endpoint.txt", "data_plane.txt")
FLEETS = {
    "coordinator": TORCH_FLEET,
    "trainer": TORCH_FLEET,
    "rollout": TORCH_FLEET,
    "endpoint": TORCH_FLEET,
    "buffer": ("base.txt", "data_plane.txt", "buffer.txt"),
    "sandbox-service": ("base.txt", "sandbox.txt"),
    "redis": (),
}
# The Redis image installs these Debian packages (redis-tools carries the server binary).
REDIS_DEBS = ("redis-tools", "libjemalloc2", "liblzf1", "libatomic1")
SOURCES = ("dockyard", "services", "examples/configs")
REPOSITORY = "dockyard"


def requirements(files: tuple[str, ...]) -> list[str]:
    lines = [line for name in files for line in _requirements_file(IMAGES / "requirements" / name)]
    torch_spec = os.environ.get("TORCH_SPEC")
    if torch_spec:
        lines = [torch_spec if line.startswith("torch==") else line for line in lines]
    return lines


def source_files() -> list[Path]:
    """The files an image copies to /app, in a stable order (no caches)."""
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found.append(path)
    return found


def content_hash(base_id: str, dockerfile: str, reqs: list[str], sources: list[Path]) -> str:
    digest = hashlib.sha256("\0".join([base_id, dockerfile, *reqs]).encode())
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# bookworm's python3, in full: markers such as python_full_version < "3.11.3" must see it.
IMAGE_PYTHON = "3.11.2"
# Binary wheels the image's glibc (bookworm: 2.36) runs; pip does not widen a --platform by itself.
PLATFORMS = ("linux_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 37)))


def download_wheels(requirements: list[str], folder: Path) -> None:
    """`pip download` binary wheels of `requirements` and their dependencies for the image's Python
    into `folder`; wheels already there are not fetched again."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        req.write("\n".join(requirements) + "\n")
        req.flush()
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:"]
            + ["--python-version", IMAGE_PYTHON, "--implementation", "cp", *platforms]
            + ["--dest", str(folder), "-r", req.name],
            check=True,
        )


def build(client, context: Path, tag: str, base_image: str, content_hash: str) -> None:
    """Build with --network none; a failure raises with the build's own output, not just the last line.

    The image the tag named before is removed when nothing else uses it, so rebuilds leave no
    dangling images behind (the venv stage stays: it is the cache of the next source-only rebuild).
    """
    import docker.errors

    try:
        previous = client.images.get(tag).id
    except docker.errors.ImageNotFound:
        previous = None
    try:
        _build(client, context, tag, base_image, content_hash)
    except docker.errors.BuildError as exc:
        output = "".join(chunk.get("stream", chunk.get("error", "")) for chunk in exc.build_log)
        raise RuntimeError(f"building {tag} failed:\n{output[-4000:]}") from None
    if previous and previous != client.images.get(tag).id:
        try:
            client.images.remove(previous)
        except docker.errors.APIError:
            pass  # still used by a container or tagged elsewhere: left alone


def download_debs(packages: tuple[str, ...], folder: Path) -> None:
    """`apt-get download` the packages for the image (needs the host's apt lists: apt-get update)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["apt-get", "download", *packages], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"apt-get download {' '.join(packages)} failed (run apt-get update?): {done.stderr.strip()}")


def ensure_fleet_image(client, name: str, *, base_image: str, wheelhouse: Path, tag_suffix: str) -> str:
    """dockyard/<name><tag_suffix>, built unless its content-hash label matches; returns the tag."""
    tag = f"{REPOSITORY}/{name}{tag_suffix}"
    dockerfile = (IMAGES / name / "Dockerfile").read_text()
    if name == "redis":
        wanted = content_hash(client.images.get(base_image).id, dockerfile, list(REDIS_DEBS), [])
        if _label(client, tag) != wanted:
            with tempfile.TemporaryDirectory(prefix="dockyard-fleet-") as tmp:
                (Path(tmp) / "Dockerfile").write_text(dockerfile)
                download_debs(REDIS_DEBS, Path(tmp) / "debs")
                build(client, Path(tmp), tag, base_image, wanted)
        return tag
    reqs = requirements(FLEETS[name])
    sources = source_files()
    wanted = content_hash(client.images.get(base_image).id, dockerfile, reqs, sources)
    if _label(client, tag) == wanted:
        return tag
    # One wheelhouse per requirement set: the torch images share theirs (and so their cached layers).
    wheels = wheelhouse / "fleet" / hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:16]
    download_wheels(reqs, wheels)
    with tempfile.TemporaryDirectory(prefix="dockyard-fleet-") as tmp:
        context = Path(tmp)
        (context / "Dockerfile").write_text(dockerfile)
        (context / "requirements.txt").write_text("\n".join(reqs) + "\n")
        shutil.copytree(wheels, context / "wheels")
        for path in sources:
            target = context / "app" / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            os.utime(target, (0, 0))  # the same source gives the same COPY layer in every image
        build(client, context, tag, base_image, wanted)
    return tag


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the service images offline (skips what is up to date).")
    parser.add_argument("--only", default=",".join(FLEETS), help=f"comma-separated subset of {', '.join(FLEETS)}")
    parser.add_argument("--base-image", default=BASE_IMAGE)
    parser.add_argument("--wheelhouse", default=str(DEFAULT_WHEELHOUSE), help="host folder for downloaded wheels")
    parser.add_argument("--tag-suffix", default=":latest", help="appended to dockyard/<fleet>")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if unknown := [n for n in names if n not in FLEETS]:
        parser.error(f"unknown fleet(s) {', '.join(unknown)}; choose from {', '.join(FLEETS)}")

    import docker

    client = docker.from_env(timeout=1800)
    for name in names:
        start = time.monotonic()
        tag = ensure_fleet_image(
            client, name, base_image=args.base_image, wheelhouse=Path(args.wheelhouse), tag_suffix=args.tag_suffix
        )
        size = client.images.get(tag).attrs["Size"] / 1e6
        print(f"{name} image: {tag} ({size:.0f} MB, {time.monotonic() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
