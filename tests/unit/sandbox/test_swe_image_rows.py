"""SWE-smith and R2E-Gym rows (tests/fixtures/swe_formats) scored on a real docker engine, each in an image built
here (the sandbox image plus a tiny repository laid out as the dataset's images lay it out) and tagged under the
name the row gives; no registry answers here. SWE-smith: /testbed holds the repository before the bug, the row's
patch makes the start state. R2E-Gym: /testbed holds the buggy repository and run_tests.sh, /r2e_tests the tests.
For each: the gold solution resolves, no change and an unrelated change do not, the held-out tests are nowhere in
a session, and the verdict follows the format's rule."""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
from pathlib import Path

import pytest

from services.sandbox.backend import ResourceLimits, Status
from services.sandbox.images import SANDBOX_IMAGE
from services.sandbox.settings import SandboxSettings
from tests.conftest import missing, require_docker, require_tool
from tests.unit.sandbox.swe_repo import BUGGY, FIXED, cheat_patch, git

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "swe_formats"
LIMITS = ResourceLimits(timeout_seconds=120, memory_mb=1024, cpu_seconds=120, max_output_bytes=16384)
DEAD_REGISTRY = "127.0.0.1:9"  # nothing listens there: an image that is not present cannot be had
GOLD_R2E = (
    "--- a/pkg/core.py\n+++ b/pkg/core.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
)
UNRELATED = "--- /dev/null\n+++ b/NOTES.txt\n@@ -0,0 +1 @@\n+notes\n"
SWE_SMITH_TESTS = (
    "from pkg import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n"
)
R2E_TESTS = (
    "from pkg import add\n\n\nclass TestCore:\n    def test_add(self):\n        assert add(2, 3) == 5\n\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n\n\ndef test_known_bug():\n    assert add(1, 1) == 3\n"
)
DOCKERFILE = """FROM {base}
USER root
COPY testbed /testbed
{extra}
RUN echo /testbed > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/testbed.pth"
USER 1000:1000
"""


@pytest.fixture
def client():
    require_docker()
    require_tool("/usr/bin/git", "git")
    import docker
    import docker.errors

    engine = docker.from_env(timeout=120)
    try:
        engine.images.get(SANDBOX_IMAGE)
    except docker.errors.ImageNotFound:
        missing(f"{SANDBOX_IMAGE} is not built (deploy/images/build.sh)")
    return engine


def build_image(client, context: Path, name: str, files: dict[str, str], r2e_tests: str | None) -> None:
    """The sandbox image + /testbed (a git repository of `files`, as the dataset's images hold it) and, for
    R2E-Gym, /r2e_tests; built offline and tagged `name`."""
    testbed = context / "testbed"
    for rel, text in files.items():
        (testbed / rel).parent.mkdir(parents=True, exist_ok=True)
        (testbed / rel).write_text(text)
    git(testbed, "init", "--quiet")
    git(testbed, "add", "--all")
    git(testbed, "commit", "--quiet", "-m", "Initial commit")
    extra = ""
    if r2e_tests is not None:
        (context / "r2e_tests").mkdir()
        (context / "r2e_tests" / "test_1.py").write_text(r2e_tests)
        extra = "COPY r2e_tests /r2e_tests"
    (context / "Dockerfile").write_text(DOCKERFILE.format(base=SANDBOX_IMAGE, extra=extra))
    client.images.build(path=str(context), tag=name, network_mode="none", pull=False, rm=True)


@pytest.fixture
def images(client):
    """Builds images a test names (each under a fresh tag, so runs never share one); removes them afterwards."""
    names: list[str] = []

    def make(context: Path, name: str, files: dict[str, str], r2e_tests: str | None = None) -> str:
        build_image(client, context, name, files, r2e_tests)
        names.append(name)
        return name

    yield make
    for name in names:
        client.images.remove(name, force=True, noprune=False)


def task_set(root: Path, fixture: str, **changes) -> dict:
    row = {**json.loads((FIXTURES / fixture).read_text()), **changes}
    (root / "set").mkdir(parents=True)
    (root / "set" / "instances.jsonl").write_text(json.dumps(row) + "\n")
    return row


async def scored(root: Path, patches: list[str], probe: str | None = None, fix: str | None = None):
    """The verdicts of `patches`, a session's output of `probe`, and the patch and verdict of a session that
    runs `fix` (its work folder diffed against the start tree, as ScoreSession does), for the one row."""
    from services.sandbox.__main__ import make_swe_scorer
    from services.sandbox.checkouts import tree_patch
    from services.sandbox.docker_backend import DockerBackend

    settings = SandboxSettings(backend="docker", task_root=str(root), image_registry=DEAD_REGISTRY)
    backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(root))
    scorer = make_swe_scorer(settings, backend)
    try:
        (instance,) = scorer.task_sets.instances("set").values()
        results = await asyncio.gather(*(scorer.score("set", instance, p, LIMITS) for p in patches))
        seen = session_patch = session_result = None
        if probe is not None:
            checkout, image = await scorer.prepare("set", instance)
            session = await backend.open_session({}, LIMITS, seed_dir=str(checkout), image=image)
            try:
                seen = await session.exec(["sh", "-c", probe], None, LIMITS)
                if fix is not None:
                    assert (await session.exec(["sh", "-c", fix], None, LIMITS)).status is Status.PASSED
                    session_patch = await tree_patch(checkout, await session.export_tree(tempfile.mkdtemp(dir=root)))
            finally:
                await session.close()
        if session_patch is not None:
            session_result = await scorer.score("set", instance, session_patch, LIMITS)
        return instance, results, seen, (session_patch, session_result)
    finally:
        scorer.close()
        await backend.close()


def why(result) -> tuple:
    return result.status, result.error_message, result.outcome and result.outcome.stdout[-3000:]


async def test_a_swe_smith_row_scores_in_its_image_from_the_bug_its_patch_makes(client, images, tmp_path):
    image = f"swebench/swesmith.x86_64.example-org_1776_calc.{secrets.token_hex(4)}"
    row = task_set(tmp_path, "swe-smith.jsonl", image_name=image)
    files = {
        "pkg/__init__.py": "from pkg.core import add\n",
        "pkg/core.py": FIXED,
        "tests/test_core.py": SWE_SMITH_TESTS,
    }
    images(tmp_path / "ctx", f"{image}:latest", {**files, ".gitignore": "__pycache__/\n"})
    probe = (
        "cat pkg/core.py; ls tests; git log --all --oneline | wc -l; ls /testbed/tests; "
        "python -c 'import pkg; print(pkg.add(2, 3))'"
    )
    fix = "sed -i 's/a - b/a + b/' pkg/core.py && python -c 'import pkg; assert pkg.add(2, 3) == 5'"
    instance, (gold, empty, unrelated, cheat), session, (fixed, fixed_result) = await scored(
        tmp_path, [reverse(row["patch"]), "", UNRELATED, cheat_patch()], probe, fix
    )
    assert instance.patch == reverse(row["patch"])
    assert gold.status == "passed" and gold.fail_to_pass == {"tests/test_core.py::test_add": True}, why(gold)
    assert empty.status == "patch_failed" and not empty.resolved
    assert unrelated.status == "failed" and unrelated.fail_to_pass == {"tests/test_core.py::test_add": False}
    assert unrelated.pass_to_pass == {"tests/test_core.py::test_zero": True}, why(unrelated)
    assert cheat.status == "failed", why(cheat)  # the fixed source is in no object of the run's repository
    assert session.status is Status.PASSED, session
    assert session.stdout.startswith(BUGGY), session.stdout  # the start state: the row's patch applied
    # The FAIL_TO_PASS file is held out (SWE-smith's "Remove F2P Tests"); one commit; /testbed is the work tree.
    assert session.stdout[len(BUGGY) :].split() == ["1", "-1"], session.stdout
    # A session's own fix, diffed against the start tree: pkg/core.py alone (bytecode left out), and it resolves.
    assert [line for line in fixed.splitlines() if line.startswith("+++")] == ["+++ b/pkg/core.py"], fixed
    assert fixed_result.status == "passed", why(fixed_result)


async def test_an_r2e_gym_row_scores_by_its_expected_statuses(client, images, tmp_path):
    image = f"namanjain12/calc_final:{secrets.token_hex(6)}"
    task_set(tmp_path, "r2e-gym.jsonl", docker_image=image)
    files = {
        "pkg/__init__.py": "from pkg.core import add\n",
        "pkg/core.py": BUGGY,
        "run_tests.sh": "python -m pytest -rA -p no:cacheprovider r2e_tests\n",
        ".venv/bin/marker": "env\n",  # R2E-Gym's environment lives in the repository folder
    }
    images(tmp_path / "ctx", image, files, R2E_TESTS)
    probe = (
        "ls; ls / | grep -c r2e_tests; git log --all --oneline | wc -l; git ls-files .venv | wc -l; "
        "git status --porcelain | wc -l; cat .venv/bin/marker"
    )
    fix = "printf 'def add(a, b):\\n    return a + b\\n' > pkg/core.py"
    instance, (gold, empty, unrelated), session, (fixed, fixed_result) = await scored(
        tmp_path, [GOLD_R2E, "", UNRELATED], probe, fix
    )
    assert instance.instance_id == image
    # Resolved although test_known_bug fails: R2E-Gym expects it to.
    assert gold.status == "passed" and gold.statuses.get("r2e_tests/test_1.py::test_known_bug") == "FAILED", why(gold)
    assert (gold.tests_passed, gold.tests_total) == (3, 3)
    assert empty.status == "patch_failed" and not empty.resolved
    assert unrelated.status == "failed", why(unrelated)
    assert unrelated.fail_to_pass == {"TestCore.test_add": False, "test_known_bug": True, "test_zero": True}
    assert (unrelated.tests_passed, unrelated.tests_total) == (2, 3)  # the pass fraction: statuses as expected
    assert session.status is Status.PASSED, session
    # run_tests.sh and r2e_tests are held out of the tree, /r2e_tests out of the image; one commit.
    # The environment is in the tree, not in its commit (nothing to diff), nor in a session's patch.
    assert session.stdout.split() == ["pkg", "0", "1", "0", "0", "env"], session.stdout
    assert [line for line in fixed.splitlines() if line.startswith("+++")] == ["+++ b/pkg/core.py"], fixed
    assert fixed_result.status == "passed", why(fixed_result)


async def test_a_run_that_touches_the_held_out_tests_is_flagged(client, images, tmp_path):
    image = f"namanjain12/calc_final:{secrets.token_hex(6)}"
    task_set(tmp_path, "r2e-gym.jsonl", docker_image=image)
    files = {"pkg/__init__.py": "from pkg.core import add\n", "pkg/core.py": BUGGY, "run_tests.sh": "exit 0\n"}
    images(tmp_path / "ctx", image, files, R2E_TESTS)
    rewrite = "--- /dev/null\n+++ b/run_tests.sh\n@@ -0,0 +1 @@\n+echo PASSED r2e_tests/test_1.py::test_zero\n"
    _, (result,), _, _ = await scored(tmp_path, [rewrite])
    assert result.protected_paths_touched == ["run_tests.sh"] and result.integrity_violation
    assert result.status == "failed", why(result)  # the held-out script replaced the patch's own


async def test_a_row_whose_patch_does_not_apply_to_its_image_is_an_error_naming_it(client, images, tmp_path):
    image = f"swebench/swesmith.x86_64.example-org_1776_calc.{secrets.token_hex(4)}"
    row = task_set(tmp_path, "swe-smith.jsonl", image_name=image)
    images(tmp_path / "ctx", f"{image}:latest", {"pkg/core.py": "def add(a, b):\n    return b + a\n"})
    _, (result,), _, _ = await scored(tmp_path, [reverse(row["patch"])])
    assert result.status == "error" and not result.resolved
    assert f"instance {row['instance_id']!r}" in result.error_message
    assert "cannot apply the row's patch to the image's repository" in result.error_message, result.error_message


async def test_a_row_whose_image_cannot_be_had_is_an_error_naming_instance_and_image(client, tmp_path):
    image = f"namanjain12/absent_final:{secrets.token_hex(6)}"
    task_set(tmp_path, "r2e-gym.jsonl", docker_image=image)
    _, (result,), _, _ = await scored(tmp_path, [GOLD_R2E])
    assert result.status == "error" and f"instance {image!r}" in result.error_message
    assert f"{DEAD_REGISTRY}/{image}" in result.error_message and "cannot be pulled" in result.error_message


def reverse(patch: str) -> str:
    from services.sandbox.swe_formats import reverse_patch

    return reverse_patch(patch)
