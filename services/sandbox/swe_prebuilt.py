"""A row's prebuilt image: found locally, or pulled from the deployment's registry, then fitted to a run.

    PrebuiltEnv.image (as the dataset names it, e.g. swebench/sweb.eval.x86_64.<id>:latest)
      present locally under that name, or under <registry>/<name> ──> used as it is, no pull
      else pull <registry>/<name> (DOCKYARD_SANDBOX_IMAGE_REGISTRY, replacing a host the name carries; empty:
           the name as it is, Docker Hub's for a bare one), credentials from DOCKYARD_SANDBOX_IMAGE_REGISTRY_AUTH_FILE
      else PrebuiltImageError naming the instance, the image and the engine's answer
    image ──fit──> dockyard/swe-prebuilt:<hash of its id, repo_dir, env_bin>:  FROM image; repo_dir -> a link
           to /work (the run's checkout of base_commit), env_bin first on PATH (the driver's and a session's
           `python` is the image's environment's), the format's hidden paths removed (R2E-Gym's /r2e_tests),
           USER 1000:1000, WORKDIR /work   (built once, offline)

Guarantees: a present image is never pulled again; the pull's credentials come only from the
auth file the deployment names (JSON: {"username": ..., "password": ...}), never from a job or a
row; nothing but the pull reaches a network (the fit builds with --network none, no pull). The
image's environment (e.g. SWE-bench's conda env, installed editable at /testbed) then finds the run's
checkout where it expects the repository.

Not covered: for a row started from base_commit (swe-bench, swe-gym, swe-rebench), what the image
built inside its repository folder (compiled extensions built in place, as astropy or scikit-learn
do) is hidden by the checkout; such rows fail their tests rather than pass. Rows started from their
image (swe-smith, r2e-gym) keep it: their checkout is the image's folder (swe_image_trees.py).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from services.sandbox.images import _build, _label, _lock
from services.sandbox.swe_formats import PrebuiltEnv

FITTED_REPOSITORY = "dockyard/swe-prebuilt"
FIT_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
USER root
ARG REPO_DIR
ARG ENV_BIN
ARG HIDDEN=""
RUN rm -rf "$REPO_DIR" $HIDDEN && mkdir -p "$(dirname "$REPO_DIR")" && ln -s /work "$REPO_DIR"
ENV PATH=${ENV_BIN}:${PATH}
USER 1000:1000
WORKDIR /work
"""


class PrebuiltImageError(RuntimeError):
    """A prebuilt image that is neither present nor pullable; the message names the instance and the image."""


def qualified(image: str, registry: str) -> str:
    """`image` under the deployment's registry (`host[:port][/path]`), any host the row's name carries
    (docker.io/..., ghcr.io/...) replaced by it; the name as it is when no registry is set."""
    if not registry:
        return image
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):  # docker's rule for a host part
        image = rest
    return f"{registry.rstrip('/')}/{image}"


def read_auth(path: str | None) -> dict | None:
    """The registry credentials of the auth file, or None; ValueError names the file and what is wrong."""
    if not path:
        return None
    try:
        auth = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"registry auth file {path}: {exc}") from None
    if not isinstance(auth, dict) or not {"username", "password"} <= set(auth):
        raise ValueError(f"registry auth file {path}: must be a JSON object with username and password")
    return {"username": str(auth["username"]), "password": str(auth["password"])}


def _present(client, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def resolve(
    client, instance_id: str, image: str, *, registry: str = "", auth_file: str | None = None, on_pull=None
) -> str:
    """The local name of the instance's image, pulled when absent (then `on_pull(name)`); PrebuiltImageError when
    it cannot be had."""
    import docker.errors

    remote = qualified(image, registry)
    for name in dict.fromkeys([image, remote]):
        if _present(client, name):
            return name
    name, _, tag = remote.rpartition(":") if ":" in remote.rsplit("/", 1)[-1] else (remote, "", "latest")
    try:
        client.images.pull(name, tag=tag, auth_config=read_auth(auth_file))
    except (docker.errors.DockerException, ValueError) as exc:
        where = f"registry {registry!r}" if registry else "its registry (DOCKYARD_SANDBOX_IMAGE_REGISTRY is unset)"
        raise PrebuiltImageError(
            f"instance {instance_id!r}: image {remote!r} is not present locally and cannot be pulled from {where}: "
            f"{str(exc)[:500]}"
        ) from None
    if on_pull is not None:
        on_pull(remote)
    return remote


def fit(client, image: str, env: PrebuiltEnv, on_build=None) -> str:
    """The run image of a resolved prebuilt image: its repository folder a link to /work (built once; then
    `on_build(tag)`)."""
    hidden = " ".join(env.hidden)  # the format's own absolute paths (swe_formats.py), never a row's
    parts = [client.images.get(image).id, env.repo_dir, env.env_bin, hidden, FIT_DOCKERFILE]
    digest = hashlib.sha256("\0".join(parts).encode())
    tag = f"{FITTED_REPOSITORY}:{digest.hexdigest()[:20]}"
    with _lock(tag):
        if _label(client, tag) is None:
            with tempfile.TemporaryDirectory(prefix="dockyard-swe-prebuilt-") as tmp:
                (Path(tmp) / "Dockerfile").write_text(FIT_DOCKERFILE)
                args = {"REPO_DIR": env.repo_dir, "ENV_BIN": env.env_bin, "HIDDEN": hidden}
                _build(client, Path(tmp), tag, image, tag.rsplit(":", 1)[1], args)
            if on_build is not None:
                on_build(tag)
    return tag


def ensure_prebuilt(
    client, instance_id: str, env: PrebuiltEnv, *, registry: str = "", auth_file=None, on_made=None
) -> str:
    """The image a prebuilt-image instance runs in: resolved (or pulled), then fitted. `on_made(image, base)`:
    told of each image this call pulled (base None) or built (base the image it was built on)."""
    made = on_made or (lambda image, base: None)
    local = resolve(
        client, instance_id, env.image, registry=registry, auth_file=auth_file, on_pull=lambda name: made(name, None)
    )
    try:
        return fit(client, local, env, on_build=lambda tag: made(tag, local))
    except Exception as exc:  # the engine's build error, with the instance and the image named
        raise PrebuiltImageError(f"instance {instance_id!r}: cannot fit image {local!r} for a run: {exc}") from None
