"""Three SWE-bench rows with only their standard fields, scored through a real sandbox service on docker.

Each row is built from a PyPI sdist by the task builder (an injected bug, the gold patch, the held-out
test patch, FAIL_TO_PASS / PASS_TO_PASS), then rewritten as SWE-bench's datasets hold rows: the
repository's real name, a `version` that swebench's specifications have, environment_setup_commit,
and nothing of dockyard's own. The sandbox runs each as swebench's spec for (repo, version) says:
its environment image (built offline from the wheelhouse, cached), its test command, its log parser.
The task sets are cached in the temp folder by a key of their inputs, and the images by their tags,
so a warm run only scores.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from tests.conftest import REPO_ROOT, docker_sandbox_env

pytestmark = pytest.mark.slow

TASK_SET = "swebench-rows"
# (sdist, the repository as SWE-bench names it, a version of swebench's specs for it, module, test file)
SOURCES = [
    ("requests==2.31.0", "psf/requests", "2.31", "requests/utils.py", "tests/test_utils.py"),
    ("pytest==8.0.2", "pytest-dev/pytest", "8.0", "src/_pytest/mark/expression.py", "testing/test_mark_expression.py"),
    ("astroid==3.0.3", "pylint-dev/astroid", "3.0", "astroid/constraint.py", "tests/test_constraint.py"),
]
STANDARD = (
    "instance_id",
    "repo",
    "base_commit",
    "patch",
    "test_patch",
    "problem_statement",
    "version",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "environment_setup_commit",
    "hints_text",
    "created_at",
)


def build_row(sdist: str, repo: str, version: str, module: str, test_file: str, root: Path) -> dict:
    """One builder-made instance, rewritten as a SWE-bench row; its mirror moved to repos/<owner>__<name>.git."""
    out = root / sdist.replace("==", "-")
    cmd = [sys.executable, "-m", "services.sandbox.task_builder", sdist, "--out", str(out)]
    cmd += ["--module", module, "--test-file", test_file, "--max-instances", "1"]
    # The host's pytest plugins (pytest-asyncio) are not the project's: keep them out of its runs.
    env = {**os.environ, "PYTEST_ADDOPTS": "-p no:asyncio"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads((out / "instances.jsonl").read_text().splitlines()[0])
    mirror = root / TASK_SET / "repos" / (repo.replace("/", "__") + ".git")
    mirror.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(next((out / "repos").iterdir()), mirror)
    upstream = subprocess.run(
        ["git", "--git-dir", str(mirror), "rev-parse", "upstream"], capture_output=True, text=True, check=True
    ).stdout.strip()
    row = {
        **built,
        "repo": repo,
        "instance_id": f"{repo.replace('/', '__')}-{built['instance_id']}",
        "version": version,
        "environment_setup_commit": upstream,
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
    }
    return {key: row[key] for key in STANDARD}


@pytest.fixture(scope="module")
def task_root() -> Path:
    key = hashlib.sha256(
        json.dumps(SOURCES).encode() + (REPO_ROOT / "services" / "sandbox" / "task_builder.py").read_bytes()
    )
    cache = Path(tempfile.gettempdir()) / "dockyard-test-cache" / f"swebench-rows-{key.hexdigest()[:16]}"
    if not (cache / TASK_SET / "instances.jsonl").is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="swebench-rows-", dir=cache.parent))
        rows = [build_row(*source, staging) for source in SOURCES]
        (staging / TASK_SET / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(staging, cache)
    return cache


def wrong_patch(row: dict, mirror: Path) -> str:
    """A patch that applies and changes the buggy module without fixing it: a comment line at its top."""
    path = row["patch"].split("\n", 1)[0].split()[-1].removeprefix("b/")  # "diff --git a/X b/X"
    show = ["git", "--git-dir", str(mirror), "show", f"{row['base_commit']}:{path}"]
    first = subprocess.run(show, capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return f"--- a/{path}\n+++ b/{path}\n@@ -1 +1,2 @@\n+# not a fix\n {first}\n"


def test_swe_bench_rows_score_as_their_specs_say(task_root, start_service, docker_sandbox_image):
    rows = [json.loads(line) for line in (task_root / TASK_SET / "instances.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(tuple(r) == STANDARD for r in rows)  # nothing but SWE-bench's fields
    env = docker_sandbox_env(docker_sandbox_image, task_root=str(task_root), max_concurrency="3")
    service = start_service("sandbox", env)

    async def score(stub, row, patch):
        request = sandbox_pb2.ScorePatchRequest(
            task_set=TASK_SET,
            instance_id=row["instance_id"],
            patch=patch,
            limits=sandbox_pb2.Limits(timeout_seconds=120, memory_mb=2048, cpu_seconds=120),
        )
        return await stub.ScorePatch(request, timeout=1200)  # a cold run builds the environment image first

    async def check(stub, row):
        mirror = task_root / TASK_SET / "repos" / (row["repo"].replace("/", "__") + ".git")
        gold = await score(stub, row, row["patch"])
        assert gold.resolved and gold.verdict.status == common_pb2.VERDICT_STATUS_PASSED, (
            row["instance_id"],
            gold.verdict.error_message,
            gold.verdict.stdout[-3000:],
        )
        total = len(row["FAIL_TO_PASS"]) + len(row["PASS_TO_PASS"])
        assert (gold.verdict.tests_passed, gold.verdict.tests_total) == (total, total)
        wrong = await score(stub, row, wrong_patch(row, mirror))
        assert wrong.verdict.status == common_pb2.VERDICT_STATUS_FAILED and not wrong.resolved, wrong.verdict
        assert not any(t.passed for t in wrong.fail_to_pass) and all(t.passed for t in wrong.pass_to_pass)
        empty = await score(stub, row, "")
        assert empty.verdict.status == common_pb2.VERDICT_STATUS_PATCH_FAILED and not empty.resolved

    async def main():
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            listed = await stub.ListInstances(sandbox_pb2.ListInstancesRequest(task_set=TASK_SET), timeout=60)
            by_id = {i.instance_id: i for i in listed.instances}
            for row in rows:  # swebench's test command and parser for the repository, not dockyard's defaults
                assert list(by_id[row["instance_id"]].test_command)[:2] == ["pytest", "-rA"]
            assert by_id[rows[0]["instance_id"]].log_parser == "parse_log_pytest_options"  # psf/requests'
            await asyncio.gather(*(check(stub, row) for row in rows))

    asyncio.run(main())
