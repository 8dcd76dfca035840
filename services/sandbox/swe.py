"""SWE-bench-style patch scoring: instance + patch -> verdict.

    ScorePatch(task_set, instance_id, patch)
      host (trusted):  inspect_patch (refuse ../, absolute, .git, binary, symlink, malformed)
                       integrity: touched paths vs test_patch paths and test files
                       checkout: a new repository holding base_commit's tree as its one commit
                         (checkouts.py, from the task set's local git mirror; cached)
      sandbox:         swe_driver.py (as run.py), in a copy of the checkout, output kept up to
                       the service's ceiling whatever the request's max_output_bytes:
                         read its inputs, delete them; git apply (then patch --fuzz=5) the patch;
                         restore the files the test patch touches; git apply the test patch (if any);
                         "<nonce> tests-start"; run the test command (2>&1); "<nonce> tests-done RC"
      host:            the whole log between the markers -> log_parsing.parse_log -> grade -> SweResult
                       (stdout / stderr then cut to the request's max_output_bytes)

Task sets live under the service's task root: `<task_root>/<name>/instances.jsonl` (one SWE-bench
instance per line) or `instances.parquet` (one per row), and `<task_root>/<name>/repos/<owner>__<repo>.git`
(a git mirror of each repo). A row is a SWE-bench dataset row as it is (`repo` as `owner/name` or a
git URL; FAIL_TO_PASS / PASS_TO_PASS as lists or JSON text). A row with only SWE-bench's fields, of a
repository swebench's specifications cover, runs as its (repo, version) spec says (swe_specs.py: the
environment image, `test_cmd` + the test patch's files, swebench's log parser for the repo); it is
refused at load when that spec cannot be built offline or its commits are not in the mirror. Rows
made by the task builder carry three optional fields of dockyard's own instead: `test_cmd` (argv
list or shell-style string, run in the repository root; absent: `pytest -rA` on the files the test
patch touches), `log_parser` (a name of swebench's PARSER_REGISTRY) and `requirements` (what the
environment image installs; absent: the sandbox image as it is, Python 3 + pytest). A task set of a
format whose rows name a prebuilt image (swe_formats.py: named in `dataset.json` or detected from
the columns; one format per task set) runs each row in that image (swe_prebuilt.py) with the
format's test command; formats that cannot be scored are refused at load, naming the instance.

Verdicts (SweResult.status):
- PASSED: resolved, every FAIL_TO_PASS test passes and every PASS_TO_PASS test is kept;
- FAILED: the tests ran and it is not resolved (tests_passed / tests_total say how far);
- PATCH_FAILED: the patch was refused before running (error_message says why) or applied neither
  with `git apply` nor with `patch --fuzz=5`; the policy's fault, a reward like FAILED;
- TIMEOUT: the wall-clock limit killed the run;
- ERROR: infrastructure: the checkout failed, the held-out test patch did not apply, the driver
  could not run, the log outgrew the service's output ceiling, or the backend reported ERROR;
  masked from rewards, never a zero.

Guarantees: in its work folder the code under test finds base_commit's tree and nothing else of
the repository (checkouts.py; the task root is outside the sandbox's mounts, except on an
unisolated local backend, which leaves the host's files readable); a log is graded whole or not
at all (ERROR), never cut short by the caller's output cap.

The nonce that brackets the log is written into the work folder and deleted by the driver before
any untrusted code runs; code under test cannot print a forged end marker without it. Log lines
inside the markers can still be forged by code under test (see log_parsing).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from dockyard.tasks.rows import read_rows
from dockyard.tasks.swe import instances_file
from services.sandbox import swe_formats
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend, Status
from services.sandbox.checkouts import Checkouts, missing_objects
from services.sandbox.log_parsing import grade, parse_log, parser_for
from services.sandbox.patches import PatchRefused, inspect_patch, protected_paths
from services.sandbox.swe_formats import PrebuiltEnv, prebuilt_env
from services.sandbox.swe_specs import EnvRecipe, covered, recipe, spec_test_cmd

log = structlog.get_logger()

DRIVER_DIR = ".dockyard-swe"
# The driver runs inside the sandbox as `python .dockyard-swe/run.py`; its source travels as a file.
DRIVER_SOURCE = (Path(__file__).with_name("swe_driver.py")).read_text()
EXIT_PATCH_FAILED = 10
EXIT_TEST_PATCH_FAILED = 11
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

    @classmethod
    def from_dict(cls, raw: dict, fmt: str | None = None) -> SweInstance:
        """A row of `fmt` (swe_formats.py; None: a SWE-bench row, plus optional test_cmd / log_parser /
        requirements); ValueError names the field."""
        # FormatRefused (a ValueError) names the instance and why, before any column is required.
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
    before; a SWE-bench row (one with a spec recipe) needs its mirror at load."""
    groups: dict[Path, list[SweInstance]] = {}
    for instance in instances:
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


@dataclass(frozen=True)
class SweResult:
    status: str  # "passed" (resolved), "failed", "patch_failed", "timeout", "error"
    tests_passed: int = 0
    tests_total: int = 0
    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)  # parsed from the log, by test id
    protected_paths_touched: list[str] = field(default_factory=list)
    outcome: Outcome | None = None  # the backend's run, when there was one
    error_message: str = ""

    @property
    def resolved(self) -> bool:
        return self.status == "passed"

    @property
    def pass_rate(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0

    @property
    def integrity_violation(self) -> bool:
        return bool(self.protected_paths_touched)


ImageResolver = Callable[[SweInstance, Path], Awaitable[str | None]]  # (instance, its mirror)


class SweScorer:
    """Scores patches against task-set instances on any SandboxBackend.

    `image_for(instance, mirror)` names the image an instance runs in: with a container backend,
    the row's prebuilt image (swe_prebuilt.py), the environment image of its swebench spec
    (swe_images.py) or the one that installs `instance.requirements`; None (the default, and what
    the local backend ignores anyway) is the backend's default image, and a prebuilt-image row
    without a resolver is an ERROR (its environment is its image). A failure there is an ERROR
    verdict. `log_cap_bytes` (the service's output ceiling) is how much of the run's output is kept
    for grading; the request's `max_output_bytes` only caps what is returned.
    """

    def __init__(
        self,
        backend: SandboxBackend,
        task_sets: TaskSets,
        *,
        log_cap_bytes: int,
        checkout_root: str | None = None,
        image_for: ImageResolver | None = None,
    ) -> None:
        self._backend = backend
        self.task_sets = task_sets
        self._log_cap_bytes = log_cap_bytes
        self._checkouts = Checkouts(checkout_root)
        self._image_for = image_for

    def close(self) -> None:
        self._checkouts.close()

    async def prepare(self, task_set: str, instance: SweInstance) -> tuple[Path, str | None]:
        """(the base-commit checkout, the image to run in): what a run, or a session, of `instance` starts from."""
        mirror = self.task_sets.mirror(task_set, instance.repo)
        checkout = await self._checkouts.get(mirror, instance.base_commit)
        if instance.prebuilt is not None and self._image_for is None:
            raise RuntimeError(
                f"instance {instance.instance_id!r} runs in its image {instance.prebuilt.image!r}, which only "
                "the docker backend provides (DOCKYARD_SANDBOX_BACKEND=docker)"
            )
        return checkout, await self.image(task_set, instance)

    async def image(self, task_set: str, instance: SweInstance) -> str | None:
        """The image `instance` runs in (pulled and fitted, or built, once); None: the backend's own."""
        if self._image_for is None:
            return None
        return await self._image_for(instance, self.task_sets.mirror(task_set, instance.repo))

    async def score(self, task_set: str, instance: SweInstance, patch: str, limits: ResourceLimits) -> SweResult:
        total = len(instance.fail_to_pass) + len(instance.pass_to_pass)
        try:
            touched = inspect_patch(patch)
        except PatchRefused as exc:
            return SweResult("patch_failed", tests_total=total, error_message=f"patch refused: {exc}")
        try:
            test_paths = held_out_paths(instance.test_patch)
        except PatchRefused as exc:
            return SweResult("error", tests_total=total, error_message=f"the instance's test_patch is unusable: {exc}")
        protected = protected_paths(touched, test_paths)
        try:
            checkout, image = await self.prepare(task_set, instance)
        except Exception as exc:  # any failure to prepare is the infrastructure's, never the policy's
            log.warning("swe preparation failed", instance=instance.instance_id, error=str(exc))
            return SweResult("error", tests_total=total, error_message=f"cannot prepare {instance.instance_id}: {exc}")
        nonce = secrets.token_hex(16)
        path = instance.prebuilt.env_bin if instance.prebuilt else ""
        spec = {"nonce": nonce, "test_cmd": instance.test_cmd, "test_files": test_paths, "path": path}
        files = {
            f"{DRIVER_DIR}/run.py": DRIVER_SOURCE,
            f"{DRIVER_DIR}/spec.json": json.dumps(spec),
            f"{DRIVER_DIR}/agent.patch": patch,
            f"{DRIVER_DIR}/test.patch": instance.test_patch,
        }
        run_limits = dataclasses.replace(limits, max_output_bytes=self._log_cap_bytes)
        outcome = await self._backend.execute(
            files, ["python", f"{DRIVER_DIR}/run.py"], run_limits, seed_dir=str(checkout), image=image
        )
        result = interpret(instance, outcome, nonce, protected)
        return dataclasses.replace(result, outcome=capped(outcome, limits.max_output_bytes))


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:]


def capped(outcome: Outcome, max_bytes: int) -> Outcome:
    """`outcome` with stdout and stderr cut to their first `max_bytes` bytes, as a backend cuts them."""
    cut = {}
    for name in ("stdout", "stderr"):
        data = getattr(outcome, name).encode("utf-8")
        if len(data) > max_bytes:
            cut[name] = data[:max_bytes].decode("utf-8", errors="ignore")
    return dataclasses.replace(outcome, **cut, output_truncated=True) if cut else outcome


def interpret(instance: SweInstance, outcome: Outcome, nonce: str, protected: list[str]) -> SweResult:
    """The backend's Outcome of the driver -> SweResult (see the module docstring for the rules)."""
    total = len(instance.fail_to_pass) + len(instance.pass_to_pass)
    common = {"tests_total": total, "protected_paths_touched": protected, "outcome": outcome}
    if outcome.status is Status.ERROR:
        return SweResult("error", error_message=outcome.error_message or "sandbox error", **common)
    if outcome.status is Status.TIMEOUT:
        return SweResult("timeout", error_message="the wall-clock limit killed the run", **common)
    if outcome.exit_code == EXIT_PATCH_FAILED:
        return SweResult("patch_failed", error_message="the patch does not apply:\n" + _tail(outcome.stderr), **common)
    if outcome.exit_code == EXIT_TEST_PATCH_FAILED:
        message = "the held-out test patch does not apply over the solution:\n" + _tail(outcome.stderr)
        return SweResult("error", error_message=message, **common)
    start = f"{nonce} tests-start\n"
    begin = outcome.stdout.find(start)
    if begin < 0:
        message = (
            f"the scoring driver did not reach the tests (exit code {outcome.exit_code}):\n{_tail(outcome.stderr)}"
        )
        return SweResult("error", error_message=message, **common)
    body = outcome.stdout[begin + len(start) :]
    done = re.search(rf"^{nonce} tests-done (-?\d+)$", body, re.MULTILINE)
    if done is None:
        if outcome.output_truncated:  # the log cannot be graded whole: not the policy's verdict
            message = "the test log exceeded the service's output ceiling (DOCKYARD_SANDBOX_MAX_OUTPUT_BYTES)"
            return SweResult("error", error_message=message, **common)
        return SweResult("failed", error_message="the test run did not finish", **common)
    statuses = parse_log(
        instance.log_parser, body[: done.start()], repo=instance.repo, instance_id=instance.instance_id
    )
    graded = grade(statuses, instance.fail_to_pass, instance.pass_to_pass)
    f2p_ok = set(graded.fail_to_pass_success)
    p2p_ok = set(graded.pass_to_pass_success)
    return SweResult(
        "passed" if graded.resolved else "failed",
        tests_passed=graded.tests_passed,
        fail_to_pass={t: t in f2p_ok for t in instance.fail_to_pass},
        pass_to_pass={t: t in p2p_ok for t in instance.pass_to_pass},
        statuses=statuses,
        **common,
    )
