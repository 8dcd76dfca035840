"""SweScorer on a real backend over a tiny task set (tests/unit/sandbox/swe_repo.py): what the code under
test can see of the repository, logs longer than the caller's output cap, empty test patches, and
SWE-bench's own row format. Each runs on the local backend and, where docker answers, on the docker one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.sandbox.backend import ResourceLimits
from services.sandbox.checkouts import Checkouts
from services.sandbox.images import SANDBOX_IMAGE
from services.sandbox.swe import SweScorer, TaskSetError, TaskSets
from tests.conftest import require_docker, require_tool
from tests.unit.sandbox.swe_repo import F2P, P2P, TEST_FILE, cheat_patch, git, make_task_set, many

LIMITS = ResourceLimits(timeout_seconds=120, memory_mb=1024, cpu_seconds=120, max_output_bytes=16384)
CEILING = 4 * 1024 * 1024


@pytest.fixture(params=["local", "docker"])
async def backend(request, tmp_path: Path):
    require_tool("/usr/bin/git", "git")
    if request.param == "local":
        from services.sandbox.local import LocalBackend

        yield LocalBackend(max_concurrency=2, work_root=str(tmp_path))
        return
    require_docker()
    from services.sandbox.docker_backend import DockerBackend

    docker_backend = await DockerBackend.open(image=SANDBOX_IMAGE, max_concurrency=2, work_root=str(tmp_path))
    yield docker_backend
    await docker_backend.close()


def scorer_for(backend, root: Path, log_cap_bytes: int = CEILING) -> SweScorer:
    return SweScorer(backend, TaskSets(str(root)), log_cap_bytes=log_cap_bytes, checkout_root=str(root))


async def score(scorer: SweScorer, patch: str, limits: ResourceLimits = LIMITS, task_set: str = "set"):
    instance = next(iter(scorer.task_sets.instances(task_set).values()))
    return await scorer.score(task_set, instance, patch, limits)


async def test_a_patch_cannot_fetch_the_fix_from_git(backend, tmp_path):
    row = make_task_set(tmp_path)
    scorer = scorer_for(backend, tmp_path)
    try:
        gold = await score(scorer, row["patch"])
        assert gold.status == "passed", gold.outcome
        cheat = await score(scorer, cheat_patch())
        assert cheat.status == "failed" and cheat.fail_to_pass == {F2P[0]: False}, cheat.outcome
    finally:
        scorer.close()


async def test_the_sandbox_sees_only_the_base_commits_tree(backend, tmp_path):
    row = make_task_set(tmp_path)
    mirror = tmp_path / "set" / "repos" / "o__r.git"
    checkouts = Checkouts(str(tmp_path))
    try:
        checkout = await checkouts.get(mirror, row["base_commit"])
        probe = "; echo =; ".join(
            [
                "git log --all --format=%H",
                "git rev-list --all",
                "git cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype)'",
                "git for-each-ref",
                "git diff HEAD --name-only",
            ]
        )
        outcome = await backend.execute({}, ["sh", "-c", probe], LIMITS, seed_dir=str(checkout))
    finally:
        checkouts.close()
    assert outcome.status.value == "passed", outcome
    log_all, rev_list, objects, refs, changed = outcome.stdout.split("=\n")
    commits = log_all.split()  # one commit, no ref but HEAD, and the files are that commit's
    assert len(commits) == 1 and rev_list.split() == commits and refs == "" and changed == ""
    tree = git(mirror, "rev-parse", f"{row['base_commit']}^{{tree}}").strip()
    expected = {line.split()[0] for line in git(mirror, "rev-list", "--objects", tree).splitlines()}
    found = dict(line.split() for line in objects.splitlines())
    assert set(found) == expected | set(commits) and found[commits[0]] == "commit"
    assert row["base_commit"] not in found  # not even the base commit: its parent and message stay out


async def test_a_correct_fix_with_a_long_log_passes_and_the_reply_is_capped(backend, tmp_path):
    row = make_task_set(tmp_path, log_bytes=45_000)  # about boltons' log
    scorer = scorer_for(backend, tmp_path)
    try:
        result = await score(scorer, row["patch"])
    finally:
        scorer.close()
    assert result.status == "passed" and result.tests_passed == 3, result.error_message
    last = many(45_000)[-1]  # graded from beyond what the reply carries
    assert result.pass_to_pass[last] and last not in result.outcome.stdout
    assert len(result.outcome.stdout.encode()) <= LIMITS.max_output_bytes and result.outcome.output_truncated


async def test_a_log_beyond_the_service_ceiling_is_an_error_not_a_failure(backend, tmp_path):
    row = make_task_set(tmp_path, log_bytes=45_000)
    scorer = scorer_for(backend, tmp_path, log_cap_bytes=20_000)
    try:
        result = await score(scorer, row["patch"])
    finally:
        scorer.close()
    assert result.status == "error" and "ceiling" in result.error_message


async def test_an_empty_test_patch_skips_that_step(backend, tmp_path):
    row = make_task_set(tmp_path, hold_out_tests=False)
    assert row["test_patch"] == ""
    scorer = scorer_for(backend, tmp_path)
    try:
        gold, none = await score(scorer, row["patch"]), await score(scorer, cheat_patch())
    finally:
        scorer.close()
    assert gold.status == "passed", (gold.error_message, gold.outcome)
    assert none.status == "failed" and none.fail_to_pass == {F2P[0]: False}


async def test_swe_bench_rows_load_and_score_as_they_are(backend, tmp_path):
    row = make_task_set(tmp_path, repo="https://github.com/o/r.git")
    instance = TaskSets(str(tmp_path)).instance("set", row["instance_id"])
    assert (instance.repo, instance.log_parser, instance.requirements) == ("o/r", "parse_log_pytest", [])
    assert instance.fail_to_pass == F2P and instance.pass_to_pass == [*P2P, many(0)[-1]]
    assert instance.test_cmd == ["pytest", "-rA", "--tb=no", "-p", "no:cacheprovider", TEST_FILE]
    scorer = scorer_for(backend, tmp_path)
    try:
        assert (await score(scorer, row["patch"])).status == "passed"
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "changes,parser",
    [
        ({"log_parser": "parse_log_pytest"}, "parse_log_pytest"),
        ({"log_parser": "pytest_v2"}, "parse_log_pytest_v2"),
        ({"log_parser": "parse_log_django"}, "parse_log_django"),
        ({"repo": "git@github.com:psf/requests.git"}, "parse_log_pytest_options"),
        ({"repo": "scikit-learn/scikit-learn", "FAIL_TO_PASS": F2P}, "parse_log_pytest_v2"),
    ],
)
def test_swe_bench_parser_names_and_repository_defaults(tmp_path, changes, parser):
    # dockyard's own test_cmd: the row runs as it says, not as swebench's spec for the repo would.
    row = {**_row(), "test_cmd": "pytest -rA", **changes}
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "instances.jsonl").write_text(json.dumps(row) + "\n")
    assert TaskSets(str(tmp_path)).instance("s", "x-1").log_parser == parser


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"log_parser": "parse_log_junit"}, ["'x-1'", "log_parser", "parse_log_junit", "PARSER_REGISTRY"]),
        ({"repo": "django/django"}, ["'x-1'", "django/django", "version '1.0'", "its versions"]),
        ({"repo": "pallets/flask", "version": "3.0"}, ["'x-1'", "pallets/flask", "mirror", "does not exist"]),
        ({"repo": "not a repo"}, ["'x-1'", "repo"]),
        ({"FAIL_TO_PASS": "[not json"}, ["'x-1'", "JSON"]),
    ],
)
def test_unsupported_rows_are_refused_naming_the_instance_and_field(tmp_path, changes, words):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "instances.jsonl").write_text(json.dumps({**_row(), **changes}) + "\n")
    with pytest.raises(TaskSetError) as err:
        TaskSets(str(tmp_path)).instances("s")
    assert all(w in str(err.value) for w in words), str(err.value)


def _row() -> dict:
    return {
        "repo": "o/r",
        "instance_id": "x-1",
        "base_commit": "a" * 40,
        "patch": "",
        "test_patch": "",
        "problem_statement": "",
        "hints_text": "",
        "created_at": "2020-01-01T00:00:00Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(F2P),
        "PASS_TO_PASS": "[]",
        "environment_setup_commit": "a" * 40,
    }


async def test_a_job_can_ask_for_the_whole_log_with_max_output_bytes_0(tmp_path):
    """env.sandbox.max_output_bytes = 0 reaches ScorePatch as 0, which returns the log up to the ceiling."""
    from dockyard.api.sandbox.v1 import sandbox_pb2
    from dockyard.config import SandboxLimits
    from services.sandbox.local import LocalBackend
    from services.sandbox.servicer import SandboxServicer
    from services.sandbox.settings import SandboxSettings

    require_tool("/usr/bin/git", "git")
    row = make_task_set(tmp_path, log_bytes=45_000)
    job = SandboxLimits(timeout_seconds=120, memory_mb=1024, cpu_seconds=120, max_output_bytes=0)
    limits = sandbox_pb2.Limits(**job.model_dump())
    settings = SandboxSettings(task_root=str(tmp_path), work_root=str(tmp_path), max_timeout_seconds=600)
    servicer = SandboxServicer(LocalBackend(max_concurrency=1, work_root=str(tmp_path)), settings)
    try:
        request = sandbox_pb2.ScorePatchRequest(
            task_set="set", instance_id=row["instance_id"], patch=row["patch"], limits=limits
        )
        reply = await servicer.ScorePatch(request, None)
    finally:
        servicer.close()
    assert reply.resolved and not reply.verdict.output_truncated, reply.verdict.error_message
    assert many(45_000)[-1] in reply.verdict.stdout
