"""Environment images of SWE-bench rows, built offline per (repo, version, spec hash).

    mirror ──git archive environment_setup_commit──> src/            (the repository as the spec installs it)
    host:  pip wheel --no-deps src (the repository's own wheel, for its dependency list)
           pip download (binary wheels, Python 3.11, x86_64) into wheelhouse/swe/<hash>:
             spec pip_packages + packages;  -r <the repository's requirements file>;
             src's [build-system] requires;  <repository wheel>[extras] (its dependencies);  pytest
    build (--network none, --no-index): SANDBOX_IMAGE + /opt/venv gets, in that order, the pip packages,
           the requirements file, the build requirements, then `pip install <flags> /work[extras]` of src
           copied to /work; /work is emptied afterwards ──> dockyard/swe-env:<hash>

Guarantees: the tag hashes the sandbox image id, repo, version, the spec's hash, the
environment_setup_commit and this recipe, so one image serves every row of a (repo, version); it is
built once (thread-safe) and later calls return at once. An editable install (`-e`, as nearly every
spec asks) points the venv at /work, where each run's checkout (base_commit + the patch) lies, as
SWE-bench's points at /testbed; a non-editable one installs the environment commit's code, which the
checkout shadows for `python -m pytest` run from /work. The image runs as uid 1000 in /work, like the
sandbox image. Failures raise EnvImageError naming the instance, the repo/version and the step
(a package with no wheel for Python 3.11 on PyPI, a build that fails); nothing reaches a network
during the image build itself.
"""

from __future__ import annotations

import hashlib
import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from services.sandbox.images import DEFAULT_WHEELHOUSE, _build, _label, _lock, download_wheels

SWE_ENV_REPOSITORY = "dockyard/swe-env"
SWE_ENV_DOCKERFILE = """\
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
USER root
ARG INSTALL
ARG REQUIREMENTS
ARG SCM_VERSION
COPY wheels /tmp/build/wheels
COPY requirements.txt build-requirements.txt /tmp/build/
COPY src /work
RUN set -e; P="/opt/venv/bin/pip install --no-index --no-cache-dir --find-links /tmp/build/wheels"; \\
    $P -r /tmp/build/requirements.txt; \\
    if [ -n "$REQUIREMENTS" ]; then cd /work && $P -r "$REQUIREMENTS"; fi; \\
    $P -r /tmp/build/build-requirements.txt; \\
    cd /work && SETUPTOOLS_SCM_PRETEND_VERSION="$SCM_VERSION" eval "$P $INSTALL"; \\
    rm -rf /tmp/build; find /work -mindepth 1 -delete; chown 1000:1000 /work
USER 1000:1000
WORKDIR /work
"""


class EnvImageError(RuntimeError):
    """An environment image that cannot be built; the message names the instance, repo/version and step."""


def swe_env_tag(client, base_image: str, instance) -> str:
    r = instance.recipe
    parts = [client.images.get(base_image).id, r.repo, r.version, r.spec_hash, instance.environment_setup_commit]
    digest = hashlib.sha256("\0".join([*parts, SWE_ENV_DOCKERFILE]).encode()).hexdigest()[:20]
    return f"{SWE_ENV_REPOSITORY}:{digest}"


def ensure_swe_env_image(
    client, base_image: str, instance, mirror: Path, wheelhouse_dir=DEFAULT_WHEELHOUSE, *, on_build=None
) -> str:
    """The environment image of `instance` (a SweInstance with a recipe); built when missing (then `on_build(tag)`)."""
    tag = swe_env_tag(client, base_image, instance)
    with _lock(tag):
        if _label(client, tag) is not None:
            return tag
        r = instance.recipe
        where = f"instance {instance.instance_id!r} ({r.repo} version {r.version!r})"
        wheels = Path(wheelhouse_dir) / "swe" / tag.rsplit(":", 1)[1]
        with tempfile.TemporaryDirectory(prefix="dockyard-swe-env-") as tmp:
            context = Path(tmp)
            src = context / "src"
            _archive(mirror, instance.environment_setup_commit, src)
            requirements_file = next((p for p in r.requirements_paths if (src / p).is_file()), "")
            build_requires = _build_requires(src)
            extras = r.install_target[1:]  # "" or "[a,b]"
            steps = [
                ("pip_packages", [*r.pip_packages, "pytest"]),
                ("packages", ["-r", str(src / requirements_file)] if requirements_file else []),
                ("build requirements", build_requires),
            ]
            for step, wanted in steps:
                if wanted:
                    label = f"{step}: pip download {' '.join(wanted).replace(str(src) + '/', '')}"
                    _step(where, label, lambda w=wanted: download_wheels(w, wheels))
            repo_wheel = _step(where, "install (pip wheel of the repository)", lambda: _repo_wheel(src, context, r))
            _step(
                where,
                "install (the repository's dependencies)",
                lambda: download_wheels([f"{repo_wheel}{extras}"], wheels),
            )
            (context / "requirements.txt").write_text("\n".join([*r.pip_packages, "pytest"]) + "\n")
            (context / "build-requirements.txt").write_text("\n".join(build_requires) + "\n")
            shutil.copytree(wheels, context / "wheels")
            install = shlex.join([*r.install_flags, f"/work{extras}"])
            args = {"INSTALL": install, "REQUIREMENTS": requirements_file, "SCM_VERSION": _scm_version(r.version)}
            (context / "Dockerfile").write_text(SWE_ENV_DOCKERFILE)
            _step(where, "image build", lambda: _build_with_args(client, context, tag, base_image, args))
        if on_build is not None:
            on_build(tag)
        return tag


def _step(where: str, step: str, action):
    """`action()`; any failure -> EnvImageError naming the instance, repo/version and step."""
    try:
        return action()
    except subprocess.CalledProcessError as exc:
        out = exc.stderr or exc.output or b""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        why = out.strip()[-1500:] or f"exit status {exc.returncode} (pip's own message is in the service's log)"
        raise EnvImageError(f"{where}: step {step!r} failed: {why}") from None
    except Exception as exc:
        raise EnvImageError(f"{where}: step {step!r} failed: {exc}"[:3000]) from None


def _archive(mirror: Path, commit: str, dest: Path) -> None:
    data = subprocess.run(
        ["git", "--git-dir", str(mirror), "archive", "--format=tar", commit], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def _build_requires(src: Path) -> list[str]:
    import tomllib  # Python 3.11+, as the sandbox service runs

    pyproject = src / "pyproject.toml"
    if pyproject.is_file():
        requires = tomllib.loads(pyproject.read_text()).get("build-system", {}).get("requires")
        if requires:
            return [*requires, "wheel"]
    return ["setuptools", "wheel"]


def _scm_version(version: str) -> str:
    return version if version.count(".") >= 2 else f"{version}.0"


def _repo_wheel(src: Path, context: Path, recipe) -> Path:
    """The repository's own wheel, built on the host (its build backend comes from the package index)."""
    out = context / "repo-wheel"
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": _scm_version(recipe.version)}
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "-w",
        str(out),
        str(src),
    ]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return next(out.glob("*.whl"))


def _build_with_args(client, context: Path, tag: str, base_image: str, args: dict[str, str]) -> None:
    import docker.errors

    try:
        _build(client, context, tag, base_image, tag.rsplit(":", 1)[1], args)
    except docker.errors.BuildError as exc:
        output = "".join(chunk.get("stream", chunk.get("error", "")) for chunk in exc.build_log)
        raise RuntimeError(output[-2000:]) from None
