"""Per-repository environment images: content-addressed, built once, usable by the docker backend."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.sandbox.backend import ResourceLimits, Status

pytestmark = pytest.mark.slow

LIMITS = ResourceLimits(timeout_seconds=30, memory_mb=256, cpu_seconds=30, max_output_bytes=4096)


def test_env_image_is_content_addressed_built_once_and_runs(docker_sandbox_image, tmp_path):
    import docker

    from services.sandbox.docker_backend import DockerBackend
    from services.sandbox.images import ensure_env_image, env_image_tag

    client = docker.from_env()
    wheelhouse = tmp_path / "wheelhouse"
    requirements = ["six==1.16.0", "attrs==24.2.0"]

    tag = ensure_env_image(client, docker_sandbox_image, requirements, wheelhouse)
    assert tag.startswith("dockyard/env:")
    # Same requirements in any order, duplicated: same tag, nothing rebuilt, no download.
    start = time.monotonic()
    built: list[str] = []
    again = ensure_env_image(
        client, docker_sandbox_image, [*reversed(requirements), "six==1.16.0"], tmp_path / "none", on_build=built.append
    )
    assert again == tag and time.monotonic() - start < 5
    assert not (tmp_path / "none").exists() and built == []  # found, not built: on_build is not called
    # Different requirements: a different tag.
    assert env_image_tag(client, docker_sandbox_image, ["six==1.16.0"]) != tag

    async def run() -> list:
        work = tmp_path / "work"
        work.mkdir()
        backend = await DockerBackend.open(image=docker_sandbox_image, max_concurrency=2, work_root=str(work))
        try:
            # An image this backend did not build is never the image cache's (its eviction cannot remove it).
            assert await backend.packages_image(requirements) == tag and tag not in backend.images.recorded()
            source = "import six, attrs, pytest, os; print(six.__version__, attrs.__version__, os.getuid())"
            in_env = await backend.execute({}, ["python", "-c", source], LIMITS, image=tag)
            in_default = await backend.execute({}, ["python", "-c", "import six"], LIMITS)
            return [in_env, in_default]
        finally:
            await backend.close()

    in_env, in_default = asyncio.run(run())
    assert (in_env.status, in_env.stdout) == (Status.PASSED, "1.16.0 24.2.0 1000\n"), in_env
    assert in_default.status == Status.FAILED and "ModuleNotFoundError" in in_default.stderr


def test_seed_folder_is_copied_in_and_writable(docker_sandbox_image, tmp_path):
    from services.sandbox.docker_backend import DockerBackend

    seed = tmp_path / "repo"
    (seed / "pkg").mkdir(parents=True)
    (seed / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (seed / "test_pkg.py").write_text("from pkg import VALUE\n\ndef test_value():\n    assert VALUE == 2\n")

    async def run():
        backend = await DockerBackend.open(image=docker_sandbox_image, max_concurrency=1)
        try:
            # The overlay replaces a seed file; the code edits another; pytest runs on the result.
            command = ["sh", "-c", "sed -i 's/1/2/' pkg/__init__.py && python -m pytest -q -p no:cacheprovider"]
            return await backend.execute({"notes.txt": "overlay"}, command, LIMITS, seed_dir=str(seed))
        finally:
            await backend.close()

    outcome = asyncio.run(run())
    assert outcome.status == Status.PASSED, outcome
    assert "1 passed" in outcome.stdout
    assert (seed / "pkg" / "__init__.py").read_text() == "VALUE = 1\n"  # the host's seed is untouched
