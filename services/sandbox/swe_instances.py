"""SWE task sets: rows of a task set's instances file -> SweInstance, refused at load with the line and the reason.

    <task_root>/<name>/instances.jsonl | instances.parquet  (+ dataset.json naming a format, optional)
        ──read_rows──> row ──swe_formats (detect or named; one format per task set)──> SweInstance.from_dict
        ──check_mirrors (repos/<owner>__<repo>.git holds every commit a row needs)──> TaskSets (kept per name)

A row is a SWE-bench dataset row as it is (`repo` as `owner/name` or a git URL; FAIL_TO_PASS /
PASS_TO_PASS as lists or JSON text). A row with only SWE-bench's fields, of a repository swebench's
specifications cover, runs as its (repo, version) spec says (swe_specs.py: the environment image,
`test_cmd` + the test patch's files, swebench's log parser for the repo); it is refused at load when
that spec cannot be built offline or its commits are not in the mirror. Rows made by the task
builder carry three optional fields of dockyard's own instead: `test_cmd` (argv list or shell-style
string, run in the repository root; absent: `pytest -rA` on the files the test patch touches),
`log_parser` (a name of swebench's PARSER_REGISTRY) and `requirements` (what the environment image
installs; absent: the sandbox image as it is, Python 3 + pytest). A task set of a format whose rows
name a prebuilt image (swe_formats.py: named in `dataset.json` or detected from the columns) runs
each row in that image (swe_prebuilt.py) with the format's test command; SWE-smith and R2E-Gym rows
start from the image's own repository (swe_image_trees.py) and need no mirror.

Guarantees: every refusal names the file and line (or row) and, where the row has one, the
instance; a task set holds one format; a row needing a mirror (a spec recipe, or a prebuilt image
started from base_commit) is refused at load when the mirror lacks one of its commits.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dockyard.tasks.rows import read_rows
from dockyard.tasks.swe import instances_file
from services.sandbox import swe_formats
from services.sandbox.checkouts import missing_objects
from services.sandbox.log_parsing import parser_for
from services.sandbox.patches import inspect_patch
from services.sandbox.swe_formats import PrebuiltEnv, prebuilt_env
from services.sandbox.swe_specs import EnvRecipe, covered, recipe, spec_test_cmd

_TASK_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class TaskSetError(Exception):
    """A task set or instance that cannot be used; `kind` is "not_found", "invalid" or "unusable"."""

    def __init__(self, message: str, *, kind: str = "unusable") -> None:
        super().__init__(message)
        self.kind = kind


def _string_list(value: object, name: str) -> list[str]:
    if isinstance(value, str):  # SWE-bench datasets store these lists as JSON text
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings")
    return list(value)


def repo_name(repo: str) -> str:
    """`owner/name`, or a git URL of one (https://host/owner/name.git, git@host:owner/name) -> `owner/name`."""
    url = re.match(r"^(?:[a-z][a-z0-9+.-]*://[^/]*|[^/@:\s]+@[^:/\s]+:)/?(.+)$", repo.strip())
    parts = (url.group(1) if url else repo.strip()).removesuffix("/").removesuffix(".git").split("/")
    if url:
        parts = parts[-2:]
    if len(parts) != 2 or not all(_TASK_SET_NAME.match(part) for part in parts):
        raise ValueError(f"repo {repo!r} is neither owner/name nor a git URL of one")
    return "/".join(parts)


TEST_CMD = ["pytest", "-rA", "--tb=no", "-p", "no:cacheprovider"]  # SWE-bench's, for pytest repositories


def held_out_paths(test_patch: str) -> list[str]:
    """The files an instance's test patch touches; none for an empty one (SWE-bench allows it)."""
    return inspect_patch(test_patch) if test_patch.strip() else []


@dataclass(frozen=True)
class SweInstance:
    instance_id: str
    repo: str  # owner/name
    base_commit: str
    patch: str  # the gold patch; never sent to the policy
    test_patch: str  # held out: applied after the solution, before the tests run; may be empty
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_cmd: list[str]
    log_parser: str = "parse_log_pytest"  # a name of swebench's PARSER_REGISTRY
    requirements: list[str] = field(default_factory=list)
    problem_statement: str = ""
    version: str = ""
    environment_setup_commit: str = ""  # the commit the environment image installs; base_commit if absent
    recipe: EnvRecipe | None = None  # swebench's spec for (repo, version), for a row with only SWE-bench's fields
    prebuilt: PrebuiltEnv | None = None  # the dataset's own image, for a row of a format that names one
    expected_statuses: dict[str, str] = field(default_factory=dict)  # R2E-Gym's verdict: every test's status

    @classmethod
    def from_dict(cls, raw: dict, fmt: str | None = None) -> SweInstance:
        """A row of `fmt` (swe_formats.py; None: a SWE-bench row, plus optional test_cmd / log_parser /
        requirements); ValueError names the field."""
        # FormatRefused (a ValueError) names the instance and why, before any column is required.
        raw = swe_formats.as_swe_row(fmt, raw)
        prebuilt = prebuilt_env(fmt, raw) if fmt is not None else None
        repo = repo_name(str(raw["repo"]))
        test_patch = str(raw.get("test_patch") or "")
        version = str(raw.get("version") or "")
        env = None
        cmd = raw.get("test_cmd")
        if fmt is not None:
            base = swe_formats.prebuilt_test_cmd(fmt, raw, spec_test_cmd(repo, version))
            test_cmd = [*base, *held_out_paths(test_patch)]
        else:
            if not {"test_cmd", "requirements"} & set(raw) and covered(repo):
                if not version:
                    raise ValueError(f"version is missing: swebench's specifications for {repo} are per version")
                env = recipe(str(raw["instance_id"]), repo, version)  # SpecRefused (a ValueError) names the step
            if cmd is None:
                test_cmd = [*(env.test_cmd if env else TEST_CMD), *held_out_paths(test_patch)]
            else:
                test_cmd = shlex.split(cmd) if isinstance(cmd, str) else _string_list(cmd, "test_cmd")
        instance = cls(
            instance_id=str(raw["instance_id"]),
            repo=repo,
            base_commit=str(raw["base_commit"]),
            patch=str(raw.get("patch", "")),
            test_patch=test_patch,
            fail_to_pass=_string_list(raw["FAIL_TO_PASS"], "FAIL_TO_PASS"),
            pass_to_pass=_string_list(raw.get("PASS_TO_PASS", []), "PASS_TO_PASS"),
            test_cmd=test_cmd,
            log_parser=parser_for(swe_formats.log_parser_of(fmt, raw) if fmt else raw.get("log_parser"), repo),
            # A prebuilt image is the environment; SWE-rebench's `requirements` column only describes it.
            requirements=[] if prebuilt else _string_list(raw.get("requirements", []), "requirements"),
            problem_statement=str(raw.get("problem_statement", "")),
            version=version,
            environment_setup_commit=str(raw.get("environment_setup_commit") or raw["base_commit"]),
            recipe=env,
            prebuilt=prebuilt,
            expected_statuses=dict(raw.get("expected_statuses") or {}),
        )
        if not instance.test_cmd:
            raise ValueError("test_cmd is empty")
        if not instance.fail_to_pass:
            raise ValueError("FAIL_TO_PASS is empty: nothing would tell a fix from no fix")
        for name in ("base_commit", "environment_setup_commit"):
            if not re.fullmatch(r"[0-9a-f]{7,40}", getattr(instance, name)):
                raise ValueError(f"{name} {getattr(instance, name)!r} is not a commit id")
        return instance


def mirror_name(repo: str) -> str:
    """`owner/name` (or a git URL of it) -> `owner__name.git`, the mirror's folder under `repos/`."""
    return repo_name(repo).replace("/", "__") + ".git"


def load_instances(path: Path) -> dict[str, SweInstance]:
    """instances.jsonl / instances.parquet -> {instance_id: instance}; ValueError names the line or row.

    The format is the one the folder's dataset.json names, else the first row's columns' (swe_formats.py)."""
    instances: dict[str, SweInstance] = {}
    named = swe_formats.named_format(path.parent)
    first: tuple[str, str | None] | None = None
    for where, raw in read_rows(path):
        fmt = named or swe_formats.detect(set(raw))
        first = first or (where, fmt)
        if fmt != first[1]:
            raise ValueError(
                f"{where}: a row of format {fmt or 'swe-bench (spec-built)'} in a task set whose first row "
                f"({first[0]}) is {first[1] or 'swe-bench (spec-built)'}; a task set holds one format"
            )
        try:
            instance = SweInstance.from_dict(raw, fmt)
        except (ValueError, KeyError, TypeError) as exc:
            name = f" instance {raw['instance_id']!r}:" if "instance_id" in raw else ""
            raise ValueError(f"{where}:{name} {type(exc).__name__}: {exc}") from None
        if instance.instance_id in instances:
            raise ValueError(f"{where}: duplicate instance_id {instance.instance_id!r}")
        instances[instance.instance_id] = instance
    return instances


MIRROR_HINT = (
    "a task set's repos/<owner>__<name>.git must be a git mirror holding every base_commit and "
    "environment_setup_commit (`git clone --mirror URL repos/<owner>__<name>.git`, then `git fetch` "
    "what is missing; docs/sandbox.md#repository-mirrors)"
)


def check_mirrors(instances, mirror_of: Callable[[str], Path]) -> None:
    """ValueError naming the instance and the commit (or requirements file) its mirror lacks.

    A row of dockyard's own whose mirror folder is missing is left to fail when scored (ERROR), as
    before; a SWE-bench row (one with a spec recipe) needs its mirror at load, and a row that starts
    from its image (SWE-smith, R2E-Gym) needs none."""
    groups: dict[Path, list[SweInstance]] = {}
    for instance in (i for i in instances if not (i.prebuilt and i.prebuilt.start == "image")):
        groups.setdefault(mirror_of(instance.repo), []).append(instance)
    for mirror, group in groups.items():
        if not mirror.is_dir():
            needy = [i for i in group if i.recipe is not None or i.prebuilt is not None]
            if needy:
                raise ValueError(
                    f"instance {needy[0].instance_id!r} ({needy[0].repo}): the git mirror {mirror} does not exist; "
                    f"{MIRROR_HINT}"
                )
            continue
        wanted = {f"{c}^{{commit}}" for i in group for c in (i.base_commit, i.environment_setup_commit)}
        files = {f"{i.environment_setup_commit}:{p}" for i in group if i.recipe for p in i.recipe.requirements_paths}
        missing = missing_objects(mirror, sorted(wanted | files))
        for i in group:
            for name in ("base_commit", "environment_setup_commit"):
                if f"{getattr(i, name)}^{{commit}}" in missing:
                    raise ValueError(
                        f"instance {i.instance_id!r}: {name} {getattr(i, name)} is not in {mirror}; {MIRROR_HINT}"
                    )
            paths = i.recipe.requirements_paths if i.recipe else ()
            if paths and all(f"{i.environment_setup_commit}:{p}" in missing for p in paths):
                raise ValueError(
                    f"instance {i.instance_id!r} ({i.repo} version {i.version!r}): step 'packages' needs one of "
                    f"{list(paths)} (swebench's requirements files for {i.repo}) at environment_setup_commit "
                    f"{i.environment_setup_commit}, and the mirror has none"
                )


class TaskSets:
    """Task sets under a root folder, loaded on first use and kept."""

    def __init__(self, root: str | None) -> None:
        self.root = Path(root) if root else None
        self._loaded: dict[str, dict[str, SweInstance]] = {}

    def names(self) -> list[str]:
        if self.root is None or not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if instances_file(p) is not None)

    def instances(self, task_set: str) -> dict[str, SweInstance]:
        if self.root is None:
            raise TaskSetError("no task root is configured (DOCKYARD_SANDBOX_TASK_ROOT)")
        if not _TASK_SET_NAME.match(task_set):
            raise TaskSetError(f"task_set {task_set!r} is not a plain folder name", kind="invalid")
        if task_set not in self._loaded:
            path = instances_file(self.root / task_set)
            if path is None:
                raise TaskSetError(f"task set {task_set!r} not found under {self.root}", kind="not_found")
            try:
                loaded = load_instances(path)
                check_mirrors(loaded.values(), lambda repo: self.mirror(task_set, repo))
                self._loaded[task_set] = loaded
            except (OSError, ValueError) as exc:
                raise TaskSetError(f"task set {task_set!r} cannot be loaded: {exc}") from None
        return self._loaded[task_set]

    def instance(self, task_set: str, instance_id: str) -> SweInstance:
        try:
            return self.instances(task_set)[instance_id]
        except KeyError:
            raise TaskSetError(
                f"instance {instance_id!r} not found in task set {task_set!r}", kind="not_found"
            ) from None

    def mirror(self, task_set: str, repo: str) -> Path:
        assert self.root is not None
        return self.root / task_set / "repos" / mirror_name(repo)
