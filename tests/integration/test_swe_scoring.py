"""SWE-style scoring end to end: builder-made task set from a real sdist -> ScorePatch on a real server.

The task set is built once per session from toolz's sdist on PyPI (`pip download`), with bugs
injected into toolz/itertoolz.py. Each instance must resolve with its gold patch and not
resolve without it; unsafe and malformed patches are PATCH_FAILED; a patch touching tests is
flagged. The same checks run on the local and the docker backend.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import subprocess
from pathlib import Path

import grpc
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from tests.conftest import TOOLZ_MODULE as MODULE
from tests.conftest import TOOLZ_TASK_SET as TASK_SET
from tests.conftest import TOOLZ_TEST_FILE as TEST_FILE

pytestmark = pytest.mark.slow

SANDBOX_BACKENDS = ["local", "docker"]
PACKAGE = "toolz"
S = common_pb2


@pytest.fixture(scope="session")
def task_root(toolz_task_root: Path) -> Path:
    return toolz_task_root


@pytest.fixture(params=SANDBOX_BACKENDS)
def sandbox_backend_kind(request) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_sandbox_image")  # built once per session; required under CI=1
    return request.param


def instances(task_root: Path) -> list[dict]:
    lines = (task_root / TASK_SET / "instances.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def score(stub, instance_id: str, patch: str, timeout: float = 120) -> sandbox_pb2.ScorePatchRequest:
    request = sandbox_pb2.ScorePatchRequest(
        task_set=TASK_SET,
        instance_id=instance_id,
        patch=patch,
        limits=sandbox_pb2.Limits(timeout_seconds=timeout, memory_mb=2048, cpu_seconds=timeout),
    )
    return stub.ScorePatch(request, timeout=180)


def test_builder_writes_swe_bench_instances(task_root):
    found = instances(task_root)
    assert len(found) == 2
    for inst in found:
        assert set(inst) >= {"instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS"}
        assert inst["FAIL_TO_PASS"] and not set(inst["FAIL_TO_PASS"]) & set(inst["PASS_TO_PASS"])
        assert f"--- a/{MODULE}" in inst["patch"] and TEST_FILE not in inst["patch"]
        assert f"+++ b/{TEST_FILE}" in inst["test_patch"]  # held out: the base commit lacks it
    assert (task_root / TASK_SET / "repos" / f"pypi__{PACKAGE}.git").is_dir()


def test_gold_resolves_and_no_fix_does_not(task_root, start_service, sandbox_backend_kind):
    service = start_service(
        "sandbox",
        {
            "DOCKYARD_SANDBOX_BACKEND": sandbox_backend_kind,
            "DOCKYARD_SANDBOX_TASK_ROOT": str(task_root),
            "DOCKYARD_SANDBOX_MAX_CONCURRENCY": "2",
        },
    )
    found = instances(task_root)
    readme_patch = "--- a/README.rst\n+++ b/README.rst\n@@ -1,2 +1,3 @@\n Toolz\n =====\n+An unrelated line.\n"

    async def main() -> None:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            listed = await stub.ListInstances(sandbox_pb2.ListInstancesRequest(), timeout=30)
            assert sorted(i.instance_id for i in listed.instances) == sorted(i["instance_id"] for i in found)
            for inst in found:
                iid, total = inst["instance_id"], len(inst["FAIL_TO_PASS"]) + len(inst["PASS_TO_PASS"])
                gold, none, irrelevant = await asyncio.gather(
                    score(stub, iid, inst["patch"]), score(stub, iid, ""), score(stub, iid, readme_patch)
                )
                assert gold.resolved and gold.verdict.status == S.VERDICT_STATUS_PASSED, gold.verdict.stdout[-3000:]
                assert (gold.verdict.tests_passed, gold.verdict.tests_total, gold.pass_rate) == (total, total, 1.0)
                assert all(t.passed and t.status == "PASSED" for t in gold.fail_to_pass)
                assert not gold.verdict.integrity_violation
                assert none.verdict.status == S.VERDICT_STATUS_PATCH_FAILED and "empty" in none.verdict.error_message
                assert irrelevant.verdict.status == S.VERDICT_STATUS_FAILED and not irrelevant.resolved
                assert not any(t.passed for t in irrelevant.fail_to_pass)
                assert all(t.passed for t in irrelevant.pass_to_pass)
                assert irrelevant.verdict.tests_passed == len(inst["PASS_TO_PASS"])

    asyncio.run(main())


def patch_of(task_root: Path, inst: dict, path: str, edit) -> str:
    """A unified diff of `edit(text)` against `path` at the instance's base commit."""
    mirror = task_root / TASK_SET / "repos" / f"pypi__{PACKAGE}.git"
    show = ["git", "--git-dir", str(mirror), "show", f"{inst['base_commit']}:{path}"]
    old = subprocess.run(show, capture_output=True, text=True, check=True).stdout
    diff = difflib.unified_diff(old.splitlines(True), edit(old).splitlines(True), f"a/{path}", f"b/{path}")
    return "".join(diff)


def test_fuzzy_fallback_and_timeout(task_root, start_service, sandbox_backend_kind):
    service = start_service(
        "sandbox", {"DOCKYARD_SANDBOX_BACKEND": sandbox_backend_kind, "DOCKYARD_SANDBOX_TASK_ROOT": str(task_root)}
    )
    inst = instances(task_root)[0]
    # The gold patch with its first context line changed: git apply refuses it, patch --fuzz takes it.
    lines = inst["patch"].splitlines(keepends=True)
    first_context = next(i for i, line in enumerate(lines) if line.startswith("@@")) + 1
    assert lines[first_context].startswith(" ")
    lines[first_context] = " # a context line that is not in the file\n"
    fuzzy = "".join(lines)
    hang = patch_of(task_root, inst, MODULE, lambda text: "while True:\n    pass\n" + text)

    async def main() -> None:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            reply = await score(stub, inst["instance_id"], fuzzy)
            assert reply.resolved, reply.verdict.stderr
            assert "git apply: exit 1" in reply.verdict.stderr and "patch --fuzz=5: exit 0" in reply.verdict.stderr
            reply = await score(stub, inst["instance_id"], hang, timeout=5)
            assert reply.verdict.status == S.VERDICT_STATUS_TIMEOUT and not reply.resolved
            assert (await score(stub, inst["instance_id"], inst["patch"])).resolved

    asyncio.run(main())


def test_bad_patches_and_integrity(task_root, start_service, sandbox_backend_kind):
    service = start_service(
        "sandbox", {"DOCKYARD_SANDBOX_BACKEND": sandbox_backend_kind, "DOCKYARD_SANDBOX_TASK_ROOT": str(task_root)}
    )
    inst = instances(task_root)[0]
    iid = inst["instance_id"]
    escape = "--- a/../outside.py\n+++ b/../outside.py\n@@ -0,0 +1 @@\n+x = 1\n"
    absolute = "--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n"
    binary = f"diff --git a/{MODULE} b/{MODULE}\nindex 1..2 100644\nGIT binary patch\nliteral 1\nIcmZ?d00001\n"
    malformed = f"--- a/{MODULE}\n+++ b/{MODULE}\n@@ -1,5 +1,5 @@\n-only one line\n"
    stale = f"--- a/{MODULE}\n+++ b/{MODULE}\n@@ -1,2 +1,2 @@\n-no such line\n+other\n context that is not there\n"
    # Leaves the bug alone; at import, takes the fixed module from the mirror's upstream branch.
    fetch_fix = patch_of(
        task_root,
        inst,
        "toolz/__init__.py",
        lambda text: (
            "import subprocess\n"
            "for ref in ('origin/upstream', 'upstream'):\n"
            f"    subprocess.run(['git', 'checkout', ref, '--', '{MODULE}'], capture_output=True)\n" + text
        ),
    )
    # The gold fix plus a test file rewritten to pass trivially: resolved, but flagged.
    cheat = inst["patch"] + "--- /dev/null\n+++ b/toolz/tests/conftest.py\n@@ -0,0 +1 @@\n+collect_ignore = []\n"

    async def main() -> None:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            for patch, words in [
                (escape, "'..'"),
                (absolute, "absolute"),
                (binary, "binary"),
                (malformed, "malformed"),
                (stale, "does not apply"),
            ]:
                reply = await score(stub, iid, patch)
                assert reply.verdict.status == S.VERDICT_STATUS_PATCH_FAILED, (words, reply.verdict)
                assert words in reply.verdict.error_message and not reply.resolved
            fetched = await score(stub, iid, fetch_fix)
            assert fetched.verdict.status == S.VERDICT_STATUS_FAILED and not fetched.resolved, fetched.verdict
            assert not any(t.passed for t in fetched.fail_to_pass)
            flagged = await score(stub, iid, cheat)
            assert flagged.verdict.integrity_violation
            assert list(flagged.verdict.protected_paths_touched) == ["toolz/tests/conftest.py"]
            # The service keeps serving, and names what it cannot find.
            assert (await score(stub, iid, inst["patch"])).resolved
            for request, code in [
                (sandbox_pb2.ScorePatchRequest(task_set=TASK_SET, instance_id="nope", patch="x"), "NOT_FOUND"),
                (sandbox_pb2.ScorePatchRequest(task_set="missing", instance_id=iid, patch="x"), "NOT_FOUND"),
                (sandbox_pb2.ScorePatchRequest(task_set="../etc", instance_id=iid, patch="x"), "INVALID_ARGUMENT"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ScorePatch(request, timeout=30)
                assert err.value.code().name == code

    asyncio.run(main())


def test_sigterm_removes_the_checkout_cache(tmp_path, start_service):
    from tests.unit.sandbox.swe_repo import make_task_set

    row = make_task_set(tmp_path / "tasks")
    work = tmp_path / "work"
    work.mkdir()
    service = start_service(
        "sandbox", {"DOCKYARD_SANDBOX_TASK_ROOT": str(tmp_path / "tasks"), "DOCKYARD_SANDBOX_WORK_ROOT": str(work)}
    )

    async def main() -> None:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            request = sandbox_pb2.ScorePatchRequest(task_set="set", instance_id=row["instance_id"], patch=row["patch"])
            await stub.ScorePatch(request, timeout=120)

    asyncio.run(main())
    assert list(work.glob("dockyard-swe-checkouts-*/*/*")), "the checkout was not cached under the work root"
    assert service.stop() == 0, service.logs()[-3000:]
    assert not list(work.iterdir()), service.logs()[-3000:]
