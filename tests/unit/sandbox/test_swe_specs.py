"""SWE-bench rows with only their standard fields: swebench's spec per (repo, version), refusals, mirrors.

Each refusal must name the instance, the repo/version and the step, at task-set load; the spec table
is swebench's (MAP_REPO_VERSION_TO_SPECS_PY of the last release that ships it).
"""

from __future__ import annotations

import json
import shutil

import pytest

from services.sandbox.swe import SweInstance, TaskSetError, TaskSets
from services.sandbox.swe_specs import SpecRefused, recipe, specs_table
from tests.unit.sandbox.swe_repo import TEST_FILE, make_task_set

STANDARD = {
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
}


def test_recipes_follow_swebenchs_specs():
    flask = recipe("pallets__flask-1", "pallets/flask", "3.0")
    assert "Werkzeug==2.3.7" in flask.pip_packages and flask.requirements_paths == ("requirements/dev.txt",)
    assert (flask.editable, flask.install_target, flask.test_cmd, flask.python) == (
        True,
        ".",
        ("pytest", "-rA"),
        "3.11",
    )
    marshmallow = recipe("m-1", "marshmallow-code/marshmallow", "3.0")
    assert (marshmallow.install_target, marshmallow.editable) == (".[dev]", True)
    requests = recipe("r-1", "psf/requests", "2.31")
    assert requests.pip_packages == ("pytest",) and not requests.editable  # `packages: pytest`, `pip install .`
    assert recipe("r-2", "psf/requests", "2.31").spec_hash == requests.spec_hash != flask.spec_hash


@pytest.mark.parametrize(
    "repo,version,words",
    [
        ("matplotlib/matplotlib", "3.5", ["step 'pre_install'", "apt-get"]),
        ("django/django", "3.0", ["step 'eval_commands'"]),
        ("django/django", "1.4", ["step 'install'", "setup.py"]),
        ("pydata/xarray", "0.12", ["step 'packages'", "conda environment.yml"]),
        ("psf/requests", "9.9", ["no specification for this version", "'2.31'"]),
        ("o/not-covered", "1.0", ["do not cover o/not-covered"]),
    ],
)
def test_refusals_name_the_instance_version_and_step(repo, version, words):
    with pytest.raises(SpecRefused) as err:
        recipe("inst-7", repo, version)
    message = str(err.value)
    assert f"instance 'inst-7' ({repo} version {version!r})" in message and all(w in message for w in words), message


def test_every_spec_in_the_table_gives_a_recipe_or_a_named_refusal():
    outcomes = {"recipe": 0, "refused": 0}
    for repo, versions in specs_table()["specs"].items():
        for version in versions:
            try:
                recipe("i", repo, version)
                outcomes["recipe"] += 1
            except SpecRefused as exc:
                assert f"({repo} version {version!r}): step '" in str(exc), str(exc)
                outcomes["refused"] += 1
    assert outcomes["recipe"] > 100 and outcomes["refused"] > 10, outcomes


def _standard_row(tmp_path, repo="psf/requests", version="2.31", name="set") -> dict:
    """A task set whose one row has only SWE-bench's standard fields, for `repo`, with its mirror."""
    row = make_task_set(tmp_path, name, repo=repo)
    row["version"] = version
    row = {k: v for k, v in row.items() if k in STANDARD}
    assert set(row) == STANDARD
    repos = tmp_path / name / "repos"
    shutil.move(repos / "o__r.git", repos / (repo.replace("/", "__") + ".git"))
    (tmp_path / name / "instances.jsonl").write_text(json.dumps(row) + "\n")
    return row


def test_a_standard_row_runs_as_its_spec_says(tmp_path):
    row = _standard_row(tmp_path)
    instance = TaskSets(str(tmp_path)).instance("set", row["instance_id"])
    assert instance.recipe == recipe(row["instance_id"], "psf/requests", "2.31")
    assert instance.test_cmd == ["pytest", "-rA", TEST_FILE]  # the spec's command on the test patch's files
    assert instance.log_parser == "parse_log_pytest_options"  # swebench's for psf/requests
    assert (instance.version, instance.environment_setup_commit) == ("2.31", row["environment_setup_commit"])


def test_parquet_rows_load_as_jsonl_rows_do(tmp_path):
    import pyarrow  # a dependency of swebench's (datasets), so of every dev install
    import pyarrow.parquet as pq

    row = _standard_row(tmp_path)
    from_jsonl = TaskSets(str(tmp_path)).instance("set", row["instance_id"])
    (tmp_path / "set" / "instances.jsonl").unlink()
    pq.write_table(pyarrow.Table.from_pylist([row]), tmp_path / "set" / "instances.parquet")
    tasks = TaskSets(str(tmp_path))
    assert tasks.names() == ["set"] and tasks.instance("set", row["instance_id"]) == from_jsonl
    # The coordinator reads the same file: the prompt's public part only.
    from dockyard.tasks.swe import load_tasks

    (task,) = load_tasks(tmp_path / "set", 1)
    assert task.task_id == f"set/{row['instance_id']}" and "psf/requests" in task.prompt


@pytest.mark.parametrize("field", ["base_commit", "environment_setup_commit"])
def test_a_commit_the_mirror_lacks_is_refused_at_load(tmp_path, field):
    row = _standard_row(tmp_path)
    row[field] = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "set" / "instances.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(TaskSetError) as err:
        TaskSets(str(tmp_path)).instances("set")
    message = str(err.value)
    assert f"instance {row['instance_id']!r}" in message and f"{field} {row[field]} is not in" in message, message
    assert "git clone --mirror" in message


def test_a_missing_requirements_file_is_refused_at_load(tmp_path):
    row = _standard_row(tmp_path, repo="pallets/flask", version="3.0")  # packages: requirements.txt
    with pytest.raises(TaskSetError) as err:
        TaskSets(str(tmp_path)).instances("set")
    message = str(err.value)
    assert "(pallets/flask version '3.0'): step 'packages'" in message and "requirements/dev.txt" in message
    assert row["instance_id"] in message


def test_a_covered_repo_without_version_is_refused():
    raw = {"repo": "psf/requests", "instance_id": "x", "base_commit": "a" * 40, "FAIL_TO_PASS": ["t::a"]}
    with pytest.raises(ValueError, match="version is missing"):
        SweInstance.from_dict(raw)
    # dockyard's own fields (task builder rows) keep working for any repository, without a spec.
    own = SweInstance.from_dict({**raw, "test_cmd": "pytest -rA t.py", "requirements": []})
    assert own.recipe is None and own.test_cmd == ["pytest", "-rA", "t.py"]


def test_preflight_loads_swe_task_sets_as_the_sandbox_does(tmp_path):
    from dockyard.config import load_config
    from dockyard.preflight import ERROR, OK, check_swe_task_sets
    from tests.unit.test_preflight import REPO

    good = _standard_row(tmp_path, name="good")
    bad = _standard_row(tmp_path, version="9.9", name="bad")
    config = REPO / "examples" / "configs" / "grpo_swe.yaml"
    paths = [f"data.train.path={tmp_path / 'good'}", f"data.validation.path={tmp_path / 'bad'}"]
    train, validation = check_swe_task_sets(load_config(config, paths))
    assert (train.check, train.status) == (
        "sandbox.train",
        OK,
    ) and "1 instances (1 run by swebench's specs)" in train.message
    assert (validation.check, validation.status) == ("sandbox.validation", ERROR)
    assert f"instance {bad['instance_id']!r} (psf/requests version '9.9')" in validation.message, validation.message
    assert good["instance_id"] == bad["instance_id"]


def test_a_package_the_index_lacks_is_refused_naming_instance_and_step(tmp_path):
    """Before any image build: the download step fails (PyPI answers "no such package") and says where."""
    import dataclasses

    from services.sandbox.swe_images import EnvImageError, ensure_swe_env_image

    row = _standard_row(tmp_path)
    instance = TaskSets(str(tmp_path)).instance("set", row["instance_id"])
    absent = dataclasses.replace(instance.recipe, pip_packages=("dockyard-no-such-package==0.0.1",))
    instance = dataclasses.replace(instance, recipe=absent)

    class Images:  # the engine's answers the tag needs: the base image's id, and that no image has the tag yet
        def get(self, tag):
            if tag.startswith("dockyard/swe-env:"):
                import docker.errors

                raise docker.errors.ImageNotFound(tag)
            return type("Image", (), {"id": "sha256:base", "labels": {}})()

    client = type("Client", (), {"images": Images()})()
    mirror = tmp_path / "set" / "repos" / "psf__requests.git"
    with pytest.raises(EnvImageError) as err:
        ensure_swe_env_image(client, "dockyard/sandbox:latest", instance, mirror, tmp_path / "wheelhouse")
    message = str(err.value)
    assert f"instance {row['instance_id']!r} (psf/requests version '2.31')" in message
    assert "step 'pip_packages: pip download dockyard-no-such-package==0.0.1 pytest' failed" in message, message
