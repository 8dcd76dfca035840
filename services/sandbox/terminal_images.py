"""A terminal task's image (either format), built offline: its Dockerfile with FROM mapped onto the sandbox image.

    task folder ──translate──> Dockerfile:  FROM <any image>  ->  FROM SANDBOX_IMAGE (bookworm, python3,
                                                                 git, /opt/venv with pytest; nothing pulled)
                                            RUN ... pip install X  ->  pip install --no-index from wheels the
                                                                 host downloaded into its wheelhouse
                                            RUN apt-get / curl / wget / git clone / npm / uv ... -> refused
                               then:        WORKDIR's files -> /opt/dockyard-task/workdir (the session's
                                            seed), WORKDIR -> a link to /work, /tests, /oracle, /logs and
                                            /solution -> links into /tmp, USER 1000:1000, no ENTRYPOINT
    context = the task folder without the format's own files (task.yaml, solution.*, run-tests.sh,
              docker-compose.yaml, tests/), or a Harbor task's environment/
              ──content hash──> dockyard/terminal:<hash> (built once, reused; a task's two forms share it)
    image ──seed_folder──> host folder holding WORKDIR's files (extracted once per image)

Guarantees: a build never reaches a network (--network none, no pull); a step that needs one and
cannot be served from the wheelhouse is refused with the Dockerfile's line and the reason
(DockerfileError), as are several stages, VOLUME, a docker-compose.yaml with more than one service,
and a task whose WORKDIR is missing or "/"; tasks whose translated Dockerfile and context files are
the same share one image; concurrent calls for one image build it once.

Not covered: the task's USER is kept for its RUN steps only (a session runs as uid 1000, like every
sandbox container); apt packages beyond the base image's cannot be added.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shlex
import shutil
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dockyard.tasks import harbor
from dockyard.tasks.terminal import (
    CONTAINER_SOLUTION_DIR,
    CONTAINER_TEST_DIR,
    FORMAT_FILES,
    TaskFolder,
    TaskFormatError,
    client_environment,
)
from services.sandbox.images import DEFAULT_WHEELHOUSE, HASH_LABEL, download_wheels

TERMINAL_IMAGE_REPOSITORY = "dockyard/terminal"
SEED_DIR = "/opt/dockyard-task/workdir"
TESTS_TARGET = "/tmp/dockyard-tests"  # /tests links here: the root file system is read-only at run time
ORACLE_TARGET = "/tmp/dockyard-oracle"
LOGS_TARGET = "/tmp/dockyard-logs"  # /logs (Harbor's verifier writes the reward under it) links here
SOLUTION_TARGET = "/tmp/dockyard-solution"  # /solution, Harbor's oracle folder
WHEELS_DIR = "/tmp/dockyard-wheels"
CONTEXT_WHEELS = ".dockyard-wheels"
# A RUN segment that needs a network the build does not have; pip installs are served from wheels instead.
NETWORK_TOOLS = {
    "apt-get": "apt needs a Debian mirror",
    "apt": "apt needs a Debian mirror",
    "apk": "apk needs an Alpine mirror",
    "curl": "curl fetches from the network",
    "wget": "wget fetches from the network",
    "npm": "npm needs its registry",
    "uv": "uv needs the package index",
    "conda": "conda needs its channels",
}
_PIP_WORDS = r"(?:(?:\S*/)?python3?(?:\.\d+)? -m )?(?:\S*/)?pip3? install\b"
_PIP = re.compile(f"^{_PIP_WORDS}")
_PIP_ANYWHERE = re.compile(f"((?:^|&&|\\|\\||;|\\n)\\s*){_PIP_WORDS}")


LOGS_ROOT = "/logs"
Task = TaskFolder | harbor.HarborTask  # either format: both name their Dockerfile and build context


class DockerfileError(ValueError):
    """A task's Dockerfile or docker-compose.yaml that cannot be built here; the message says why."""


@dataclass(frozen=True)
class Translation:
    dockerfile: str
    requirements: tuple[str, ...]  # what its pip installs need from the wheelhouse


def _instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, KEYWORD, arguments) of each instruction, continuation lines joined, comments dropped."""
    out, buffer, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue  # a comment inside a continued instruction
        start = start or number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        whole = (buffer + line).strip()
        buffer = ""
        keyword, _, args = whole.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
        start = 0
    if buffer.strip():
        keyword, _, args = buffer.strip().partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    return out


def _segments(command: str) -> list[str]:
    return [s.strip() for s in re.split(r"&&|\|\||;|\n", command) if s.strip()]


def _run_step(number: int, command: str, requirements: list[str]) -> str:
    """A RUN command with its pip installs pointed at the wheels; DockerfileError for a network step."""
    if command.startswith("["):
        raise DockerfileError(f"Dockerfile line {number}: RUN in exec form is not supported here; use a shell line")
    for segment in _segments(command):
        words = segment.split()
        tool = words[0].rsplit("/", 1)[-1] if words else ""
        if _PIP.match(segment):
            args = shlex.split(_PIP.sub("", segment))
            if any(a in ("-r", "--requirement", "-e", "--editable", "--index-url", "-i") for a in args):
                raise DockerfileError(
                    f"Dockerfile line {number}: {segment!r}: only `pip install <requirements>` is served from "
                    "the wheelhouse (no -r, -e or index)"
                )
            requirements += [a for a in args if not a.startswith("-")]
        elif tool in NETWORK_TOOLS or (tool == "git" and len(words) > 1 and words[1] in ("clone", "fetch", "pull")):
            why = NETWORK_TOOLS.get(tool, "git clone needs the network")
            raise DockerfileError(
                f"Dockerfile line {number}: {segment!r}: {why}, and task images are built offline; use what the "
                "base image has (bookworm minbase: sh, bash, coreutils, python3, git, pytest) or a pip package"
            )
    return _PIP_ANYWHERE.sub(lambda m: f"{m.group(0)} --no-index --find-links {WHEELS_DIR}", command)


def _compose_env(task: Task) -> dict[str, str]:
    """The client service's literal environment entries; a Harbor task has no compose file
    (harbor.read_harbor_task refuses one)."""
    if not isinstance(task, TaskFolder):
        return {}
    try:
        return client_environment(task)
    except TaskFormatError as exc:
        raise DockerfileError(str(exc)) from None


def translate(task: Task) -> Translation:
    """The Dockerfile dockyard builds for `task`: FROM mapped, network steps served or refused, the
    session's layout appended. DockerfileError says which line cannot be built offline and why."""
    lines, requirements, workdir, stages = ["ARG BASE_IMAGE"], [], "/", 0
    for number, keyword, args in _instructions(task.dockerfile_path.read_text(encoding="utf-8")):
        if keyword == "FROM":
            stages += 1
            if stages > 1:
                raise DockerfileError(f"Dockerfile line {number}: several stages are not supported here")
            lines += ["FROM ${BASE_IMAGE}", "USER root", f"COPY {CONTEXT_WHEELS} {WHEELS_DIR}"]
            continue
        if stages == 0 and keyword != "ARG":
            raise DockerfileError(f"Dockerfile line {number}: {keyword} before FROM")
        if keyword == "RUN":
            args = _run_step(number, args, requirements)
        elif keyword == "ADD" and re.search(r"\bhttps?://", args):
            raise DockerfileError(f"Dockerfile line {number}: ADD of a URL needs the network")
        elif keyword == "VOLUME":
            raise DockerfileError(f"Dockerfile line {number}: VOLUME is not supported (the work folder holds state)")
        elif keyword in ("ENTRYPOINT", "CMD", "HEALTHCHECK", "EXPOSE", "ONBUILD", "STOPSIGNAL", "SHELL"):
            continue  # a session runs its own command
        elif keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir, args.strip("\"'")))
        lines.append(f"{keyword} {args}")
    if stages == 0:
        raise DockerfileError("Dockerfile: no FROM line")
    if workdir == "/":
        raise DockerfileError("Dockerfile: set a WORKDIR (the folder the agent starts in and the tests look at)")
    wd = shlex.quote(workdir)
    lines += [f"ENV {k}={shlex.quote(v)}" for k, v in sorted(_compose_env(task).items())]
    lines += [
        "USER root",
        f"RUN set -e; mkdir -p {SEED_DIR}; if [ -d {wd} ]; then cp -a {wd}/. {SEED_DIR}/; fi; "
        f'if [ {wd} = /work ]; then find /work -mindepth 1 -delete; else rm -rf {wd}; mkdir -p "$(dirname {wd})"; '
        f"ln -s /work {wd}; fi; rm -rf {CONTAINER_TEST_DIR} {CONTAINER_SOLUTION_DIR} {WHEELS_DIR}; "
        f"ln -s {TESTS_TARGET} {CONTAINER_TEST_DIR}; ln -s {ORACLE_TARGET} {CONTAINER_SOLUTION_DIR}; "
        f"rm -rf {LOGS_ROOT} {harbor.CONTAINER_SOLUTION_DIR}; ln -s {LOGS_TARGET} {LOGS_ROOT}; "
        f"ln -s {SOLUTION_TARGET} {harbor.CONTAINER_SOLUTION_DIR}; "
        "mkdir -p /work && chown 1000:1000 /work",
        f"ENV TEST_DIR={CONTAINER_TEST_DIR}",
        "USER 1000:1000",
        "WORKDIR /work",
        "ENTRYPOINT []",
        'CMD ["python3"]',
    ]
    return Translation("\n".join(lines) + "\n", tuple(dict.fromkeys(requirements)))


def workdir_of(translation: Translation) -> str:
    """The task's WORKDIR (the link to /work the agent and the tests start in)."""
    workdir = "/"
    for line in translation.dockerfile.splitlines():
        if line.startswith("WORKDIR ") and line != "WORKDIR /work":
            workdir = str(PurePosixPath(workdir, line.split(" ", 1)[1].strip("\"'")))
    return workdir


def _context_files(task: Task) -> list[Path]:
    """The build context's files, relative to task.environment_dir (a terminal-bench task's folder less the
    format's own files; a Harbor task's environment/)."""
    skip = FORMAT_FILES if isinstance(task, TaskFolder) else ()
    files = []
    for root, dirs, names in os.walk(task.environment_dir):
        rel_root = Path(root).relative_to(task.environment_dir)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in skip]
            names = [n for n in names if n not in skip and n != "Dockerfile"]
        dirs.sort()
        files += [rel_root / n for n in sorted(names)]
    return files


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


class TerminalImages:
    """Builds (once per content hash) and finds terminal tasks' images and their work-folder seeds."""

    def __init__(
        self,
        client,
        base_image: str,
        seed_root: str | os.PathLike,
        wheelhouse: str | os.PathLike = DEFAULT_WHEELHOUSE,
        *,
        cache=None,
    ) -> None:
        self._client, self._base = client, base_image
        self._seeds = Path(seed_root)
        self._wheelhouse = Path(wheelhouse)
        self._cache = cache  # an image_cache.ImageCache: what is built here is recorded, each use touched

    def ensure(self, task: Task) -> tuple[str, str, str]:
        """(image tag, host folder of the WORKDIR's files, the task's WORKDIR); builds what is missing."""
        translation = translate(task)
        files = _context_files(task)
        digest = hashlib.sha256()
        for part in (self._client.images.get(self._base).id, translation.dockerfile, *translation.requirements):
            digest.update(part.encode() + b"\0")
        for rel in files:
            digest.update(str(rel).encode() + b"\0" + (task.environment_dir / rel).read_bytes() + b"\0")
        content_hash = digest.hexdigest()
        tag = f"{TERMINAL_IMAGE_REPOSITORY}:{content_hash[:20]}"
        with _lock(tag):
            if not self._has(tag, content_hash):
                self._build(task, translation, files, tag, content_hash)
                if self._cache is not None:
                    self._cache.added(tag)
            elif self._cache is not None:
                self._cache.touch(tag)
            seed = self._seed(tag, content_hash[:20])
        return tag, str(seed), workdir_of(translation)

    def _has(self, tag: str, content_hash: str) -> bool:
        import docker.errors

        try:
            return (self._client.images.get(tag).labels or {}).get(HASH_LABEL) == content_hash
        except docker.errors.ImageNotFound:
            return False

    def _build(self, task: Task, translation: Translation, files: list[Path], tag: str, digest: str) -> None:
        import docker.errors

        with tempfile.TemporaryDirectory(prefix="dockyard-terminal-build-") as tmp:
            context = Path(tmp)
            for rel in files:
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(task.environment_dir / rel, context / rel)
            wheels = context / CONTEXT_WHEELS
            if translation.requirements:
                cached = self._wheelhouse / "terminal" / digest[:20]
                download_wheels(translation.requirements, cached)
                shutil.copytree(cached, wheels)
            else:
                wheels.mkdir()
            (context / "Dockerfile").write_text(translation.dockerfile)
            try:
                self._client.images.build(
                    path=str(context),
                    tag=tag,
                    buildargs={"BASE_IMAGE": self._base},
                    labels={HASH_LABEL: digest},
                    network_mode="none",
                    rm=True,
                    forcerm=True,
                    pull=False,
                )
            except docker.errors.BuildError as exc:
                said = "".join(str(step.get("stream", step.get("error", ""))) for step in exc.build_log)
                raise DockerfileError(f"task {task.task_id!r}: the image build failed: {said[-2000:]}") from None

    def _seed(self, tag: str, name: str) -> Path:
        """WORKDIR's files out of the image, once, into a host folder named for the image."""
        folder = self._seeds / name
        if folder.is_dir():
            return folder
        api = self._client.api
        container = api.create_container(tag, command=["true"], network_disabled=True)["Id"]
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self._seeds))
        try:
            stream, _ = api.get_archive(container, SEED_DIR)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                tar.extractall(tmp, filter="tar")
            try:
                (tmp / Path(SEED_DIR).name).rename(folder)
            except OSError:
                if not folder.is_dir():  # else another sandbox process on this host extracted it first
                    raise
        finally:
            api.remove_container(container, force=True)
            shutil.rmtree(tmp, ignore_errors=True)
        return folder
