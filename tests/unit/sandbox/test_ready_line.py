"""RunTests: the harness's "<nonce> ready" line never reaches the caller, whatever the verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.images import SANDBOX_IMAGE
from tests.conftest import require_docker

READY = re.compile(r"[0-9a-f]{32} ready")


@pytest.fixture(params=["local", "docker"])
async def backend(request, tmp_path: Path):
    if request.param == "local":
        from services.sandbox.local import LocalBackend

        yield LocalBackend(max_concurrency=1, work_root=str(tmp_path))
        return
    require_docker()
    from services.sandbox.docker_backend import DockerBackend

    docker_backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=1, work_root=str(tmp_path))
    yield docker_backend
    await docker_backend.close()


SPEAK = "import sys, time; sys.stderr.write('own words\\n'); sys.stderr.flush()"


@pytest.mark.parametrize("program,status", [(SPEAK, Status.PASSED), (SPEAK + "; time.sleep(60)", Status.TIMEOUT)])
async def test_the_ready_line_is_stripped_on_every_path(backend, program, status):
    outcome = await backend.run_tests(program, ["True"], ResourceLimits(3, 256, 10, 4096))
    assert outcome.status is status, outcome
    assert "own words" in outcome.stderr and not READY.search(outcome.stderr), outcome.stderr
