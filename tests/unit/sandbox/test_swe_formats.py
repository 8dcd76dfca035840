"""Rows of SWE-bench, SWE-Gym, SWE-rebench, SWE-smith and R2E-Gym (tests/fixtures/swe_formats, written by
hand in each dataset's columns) loaded as the sandbox loads a task set: the format, the image, the start
state, the test command, the grading rule, and the refusals, each naming the instance (or the line) and
what is wrong. No docker here; test_swe_image_rows.py scores such rows in images built on the spot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.sandbox.swe import TaskSetError, TaskSets, load_instances
from services.sandbox.swe_formats import (
    ENV_BIN,
    REPO_DIR,
    SWE_SMITH_TEST_CMD,
    detect,
    grade_expected,
    r2e_key,
    reverse_patch,
)
from services.sandbox.swe_prebuilt import qualified

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "swe_formats"


def task_set(tmp_path: Path, fixture: str, fmt: str | None = None, edit=None) -> Path:
    """<tmp>/set/instances.jsonl from a fixture (rows optionally edited), with dataset.json naming `fmt`."""
    folder = tmp_path / "set"
    folder.mkdir(parents=True)
    rows = [json.loads(line) for line in (FIXTURES / fixture).read_text().splitlines()]
    if edit is not None:
        rows = [edit(dict(row)) for row in rows]
    (folder / "instances.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if fmt is not None:
        (folder / "dataset.json").write_text(json.dumps({"format": fmt}))
    return folder / "instances.jsonl"


def only(path: Path):
    (instance,) = load_instances(path).values()
    return instance


def test_swe_bench_rows_named_so_run_in_the_harness_eval_image(tmp_path):
    instance = only(task_set(tmp_path, "swe-bench.jsonl", "swe-bench"))
    assert instance.prebuilt is not None and instance.recipe is None
    assert instance.prebuilt.image == "swebench/sweb.eval.x86_64.psf_1776_requests-9001:latest"
    assert (instance.prebuilt.repo_dir, instance.prebuilt.env_bin) == (REPO_DIR, ENV_BIN)
    assert instance.test_cmd == ["pytest", "-rA"]  # swebench's spec for psf/requests 2.0; no test patch here
    assert instance.fail_to_pass == ["tests/test_core.py::test_add"]


def test_swe_bench_columns_alone_keep_the_spec_built_environment(tmp_path):
    assert detect(set(json.loads((FIXTURES / "swe-bench.jsonl").read_text()))) is None
    instance = only(task_set(tmp_path, "swe-bench.jsonl"))
    assert instance.prebuilt is None and instance.recipe is not None


def test_swe_gym_rows_use_its_image_names_and_need_a_test_command(tmp_path):
    instance = only(task_set(tmp_path / "a", "swe-gym.jsonl", "swe-gym", lambda r: {**r, "test_cmd": "pytest -rA"}))
    assert instance.prebuilt.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-4242:latest"
    assert instance.test_cmd == ["pytest", "-rA"]
    with pytest.raises(ValueError) as info:  # getmoto/moto is outside swebench's table, and no test_cmd column
        load_instances(task_set(tmp_path / "b", "swe-gym.jsonl", "swe-gym"))
    assert "instances.jsonl:1:" in str(info.value) and "getmoto__moto-4242" in str(info.value)
    assert "no test command" in str(info.value)


def test_swe_rebench_rows_are_detected_and_read_their_install_config(tmp_path):
    path = task_set(tmp_path, "swe-rebench.jsonl", edit=lambda r: {**r, "test_patch": TEST_PATCH})
    instance = only(path)
    assert instance.prebuilt.image == "swerebench/sweb.eval.x86_64.example-org_1776_calc-7"
    assert instance.test_cmd == ["pytest", "--no-header", "-rA", "--tb=no", "-p", "no:cacheprovider", TEST_FILE]
    assert instance.log_parser == "parse_log_pytest"


def test_swe_rebench_install_config_as_json_text_is_read_too(tmp_path):
    as_text = lambda r: {**r, "install_config": json.dumps(r["install_config"])}  # noqa: E731
    path = task_set(tmp_path, "swe-rebench.jsonl", edit=as_text)
    assert only(path).test_cmd[:2] == ["pytest", "--no-header"]


def test_swe_smith_rows_start_from_their_image_with_the_bug_applied(tmp_path):
    row = json.loads((FIXTURES / "swe-smith.jsonl").read_text())
    instance = only(task_set(tmp_path, "swe-smith.jsonl"))
    env = instance.prebuilt
    assert env.image == row["image_name"] and env.start == "image" and env.repo_dir == REPO_DIR
    assert env.start_patch == row["patch"] and env.held_out == ("tests/test_core.py",)
    assert instance.patch == reverse_patch(row["patch"]) and "+    return a + b" in instance.patch
    assert (instance.repo, instance.base_commit) == ("swesmith/example-org__calc.1a2b3c4d", "1a2b3c4d")
    assert instance.test_cmd == [*SWE_SMITH_TEST_CMD, "tests/test_core.py"]
    assert instance.test_patch == "" and instance.log_parser == "parse_log_pytest"


def test_a_swe_smith_test_cmd_column_wins(tmp_path):
    instance = only(task_set(tmp_path, "swe-smith.jsonl", edit=lambda r: {**r, "test_cmd": "pytest test.py -rA"}))
    assert instance.test_cmd == ["pytest", "test.py", "-rA"]


def test_r2e_gym_rows_compare_every_status_with_the_expectation(tmp_path):
    instance = only(task_set(tmp_path, "r2e-gym.jsonl"))
    env = instance.prebuilt
    assert instance.instance_id == env.image == "namanjain12/calc_final:1a2b3c4d5e6f"
    assert (env.start, env.env_bin, env.hidden, env.untracked) == (
        "image",
        "/testbed/.venv/bin",
        ("/r2e_tests",),
        (".venv",),
    )
    assert env.held_out == ("run_tests.sh", "r2e_tests") and env.held_out_from == (("/r2e_tests", "r2e_tests"),)
    assert instance.test_cmd == ["bash", "run_tests.sh"] and instance.repo == "r2e-gym/calc"
    assert instance.expected_statuses == {
        "TestCore.test_add": "PASSED",
        "test_zero": "PASSED",
        "test_known_bug": "FAILED",
    }
    assert instance.fail_to_pass == sorted(instance.expected_statuses) and instance.pass_to_pass == []


def test_image_started_rows_need_no_mirror(tmp_path):
    for name in ("swe-smith", "r2e-gym"):
        task_set(tmp_path / name, f"{name}.jsonl")
        assert len(TaskSets(str(tmp_path / name)).instances("set")) == 1


@pytest.mark.parametrize(
    ("fixture", "edit", "words"),
    [
        (
            "r2e-gym.jsonl",
            lambda r: {**r, "expected_output_json": ""},
            ["calc_final:1a2b3c4d5e6f", "expected_output_json"],
        ),
        ("r2e-gym.jsonl", lambda r: {**r, "expected_output_json": "{not json"}, ["calc_final", "not JSON"]),
        ("r2e-gym.jsonl", lambda r: {**r, "commit_hash": None}, ["calc_final:1a2b3c4d5e6f", "commit_hash"]),
        (
            "swe-smith.jsonl",
            lambda r: {**r, "patch": ""},
            ["example-org__calc.1a2b3c4d.func_pm_op_swap__k3j2", "patch"],
        ),
        ("swe-smith.jsonl", lambda r: {**r, "FAIL_TO_PASS": []}, ["func_pm_op_swap__k3j2", "FAIL_TO_PASS"]),
        ("swe-smith.jsonl", lambda r: {**r, "FAIL_TO_PASS": ["../x.py::t"]}, ["k3j2", "outside the repository"]),
    ],
)
def test_rows_missing_what_their_format_needs_are_refused_by_name(tmp_path, fixture, edit, words):
    with pytest.raises(ValueError) as info:
        load_instances(task_set(tmp_path, fixture, edit=edit))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'set' / 'instances.jsonl'}:1:"), message
    assert all(word in message for word in words), message


def test_grade_expected_is_r2e_gyms_rule():
    expected = {"TestCore.test_add": "PASSED", "test_known_bug": "FAILED"}
    log = {"r2e_tests/test_1.py::TestCore::test_add": "PASSED", "r2e_tests/test_1.py::test_known_bug": "FAILED"}
    assert grade_expected(log, expected) == (True, {"TestCore.test_add": True, "test_known_bug": True})
    fixed_too = {**log, "r2e_tests/test_1.py::test_known_bug": "PASSED"}  # a status other than expected
    assert grade_expected(fixed_too, expected) == (False, {"TestCore.test_add": True, "test_known_bug": False})
    extra = {**log, "r2e_tests/test_1.py::test_new": "PASSED"}  # a test R2E-Gym did not expect
    assert grade_expected(extra, expected)[0] is False
    assert grade_expected({"r2e_tests/test_1.py::TestCore::test_add": "PASSED"}, expected)[0] is False
    assert r2e_key("\x1b[1mr2e_tests/t.py::A::b\x1b[0m - AssertionError") == "A.b"


def test_reverse_patch_undoes_modifications_creations_and_modes(tmp_path):
    import subprocess

    tree = tmp_path / "t"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "core.py").write_text("def add(a, b):\n    return a + b\n")
    (tree / "old.txt").write_text("-- a line that looks like a header\n")
    bug = (
        json.loads((FIXTURES / "swe-smith.jsonl").read_text())["patch"]
        + "diff --git a/old.txt b/old.txt\ndeleted file mode 100644\n--- a/old.txt\n+++ /dev/null\n"
        "@@ -1 +0,0 @@\n--- a line that looks like a header\n"
        "diff --git a/new.sh b/new.sh\nnew file mode 100755\n--- /dev/null\n+++ b/new.sh\n@@ -0,0 +1 @@\n+echo\n"
    )
    before = {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    run = lambda patch: subprocess.run(["git", "apply", "-"], cwd=tree, input=patch.encode(), check=True)  # noqa: E731
    run(bug)
    assert (tree / "pkg" / "core.py").read_text().endswith("a - b\n") and (tree / "new.sh").exists()
    run(reverse_patch(bug))
    assert {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file()} == before
    assert reverse_patch(reverse_patch(bug)) == bug


def test_a_task_set_holds_one_format(tmp_path):
    path = task_set(tmp_path, "swe-rebench.jsonl")
    plain = json.loads((FIXTURES / "swe-bench.jsonl").read_text())
    path.write_text(path.read_text() + json.dumps(plain) + "\n")
    with pytest.raises(ValueError, match=r"jsonl:2: a row of format swe-bench \(spec-built\).*is swe-rebench"):
        load_instances(path)


def test_a_bad_dataset_json_names_the_file_and_the_formats(tmp_path):
    path = task_set(tmp_path, "swe-bench.jsonl", "swebench-verified")
    with pytest.raises(ValueError, match=r"dataset.json: format 'swebench-verified' is not one of"):
        load_instances(path)


def test_a_prebuilt_row_needs_its_mirror_at_load(tmp_path):
    task_set(tmp_path, "swe-rebench.jsonl")
    with pytest.raises(TaskSetError) as info:
        TaskSets(str(tmp_path)).instances("set")
    assert "example-org__calc-7" in str(info.value) and "example-org__calc.git" in str(info.value)


def test_fixtures_are_the_formats_they_are_named_after():
    for fixture, expected in [("swe-rebench", "swe-rebench"), ("swe-smith", "swe-smith"), ("r2e-gym", "r2e-gym")]:
        assert detect(set(json.loads((FIXTURES / f"{fixture}.jsonl").read_text()))) == expected


TEST_FILE = "tests/test_core.py"
TEST_PATCH = (
    f"diff --git a/{TEST_FILE} b/{TEST_FILE}\n--- a/{TEST_FILE}\n+++ b/{TEST_FILE}\n"
    "@@ -1 +1,2 @@\n import calc\n+assert calc\n"
)


def test_the_registry_replaces_the_host_a_row_names():
    assert qualified("swebench/sweb.eval.x86_64.a_1776_b-1:latest", "") == "swebench/sweb.eval.x86_64.a_1776_b-1:latest"
    assert qualified("swebench/x:latest", "mirror.local:5000/") == "mirror.local:5000/swebench/x:latest"
    assert qualified("docker.io/swerebench/x", "mirror.local:5000/hub") == "mirror.local:5000/hub/swerebench/x"
    assert qualified("localhost/x", "reg") == "reg/x" and qualified("x", "reg") == "reg/x"


def test_the_driver_parses_as_python_3_5():
    """A prebuilt image's own environment runs the scoring driver; SWE-bench's oldest are Python 3.5."""
    import ast

    from services.sandbox.swe import DRIVER_SOURCE

    ast.parse(DRIVER_SOURCE, feature_version=(3, 5))  # SyntaxError (e.g. an f-string) fails the test


@pytest.mark.parametrize("fixture", ["swe-smith.jsonl", "r2e-gym.jsonl", "swe-rebench.jsonl"])
def test_the_coordinator_names_each_row_as_the_sandbox_does(tmp_path, fixture):
    from dockyard.tasks.swe import load_tasks, split_task_id

    instance = only(task_set(tmp_path, fixture))
    (task,) = load_tasks(tmp_path / "set", 1, agentic=True)
    assert split_task_id(task.task_id) == ("set", instance.instance_id)
    assert "add() subtracts" in task.prompt
