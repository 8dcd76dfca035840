"""SWE-bench-style patch scoring: instance + patch -> verdict.

    ScorePatch(task_set, instance_id, patch)
      host (trusted):  inspect_patch (refuse ../, absolute, .git, binary, symlink, malformed)
                       checkout: a new repository holding base_commit's tree as its one commit
                         (checkouts.py, from the task set's local git mirror; cached), or, for a
                         SWE-smith or R2E-Gym row, the start tree taken from its image and the
                         held-out tests as a test patch (swe_image_trees.py; cached)
                       integrity: touched paths vs the test patch's paths and test files
      sandbox:         swe_driver.py (as run.py), in a copy of the checkout, output kept up to
                       the service's ceiling whatever the request's max_output_bytes:
                         read its inputs, delete them; git apply (then patch --fuzz=5) the patch;
                         restore the files the test patch touches; git apply the test patch (if any);
                         "<nonce> tests-start"; run the test command (2>&1); "<nonce> tests-done RC"
      host:            the whole log between the markers -> log_parsing.parse_log -> grade -> SweResult
                       (stdout / stderr then cut to the request's max_output_bytes)

Task sets, rows and their formats: swe_instances.py (its names are re-exported here).

Verdicts (SweResult.status):
- PASSED: resolved, every FAIL_TO_PASS test passes and every PASS_TO_PASS test is kept (an R2E-Gym
  row: every test's status is the one expected_output_json names, swe_formats.grade_expected);
- FAILED: the tests ran and it is not resolved (tests_passed / tests_total say how far);
- PATCH_FAILED: the patch was refused before running (error_message says why) or applied neither
  with `git apply` nor with `patch --fuzz=5`; the policy's fault, a reward like FAILED;
- TIMEOUT: the wall-clock limit killed the run;
- ERROR: infrastructure: the checkout failed, the held-out test patch did not apply, the driver
  could not run, the log outgrew the service's output ceiling, or the backend reported ERROR;
  masked from rewards, never a zero.

Guarantees: in its work folder the code under test finds the start tree and nothing else of the
repository (checkouts.py, swe_image_trees.py; the task root is outside the sandbox's mounts, except
on an unisolated local backend, which leaves the host's files readable); a log is graded whole or
not at all (ERROR), never cut short by the caller's output cap.

The nonce that brackets the log is written into the work folder and deleted by the driver before
any untrusted code runs; code under test cannot print a forged end marker without it. Log lines
inside the markers can still be forged by code under test (see log_parsing).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from services.sandbox import swe_formats
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend, Status
from services.sandbox.checkouts import Checkouts
from services.sandbox.log_parsing import grade, parse_log
from services.sandbox.patches import PatchRefused, inspect_patch, protected_paths
from services.sandbox.swe_instances import (
    MIRROR_HINT,
    TEST_CMD,
    SweInstance,
    TaskSetError,
    TaskSets,
    check_mirrors,
    held_out_paths,
    load_instances,
    mirror_name,
    repo_name,
)

__all__ = [  # the task-set names, re-exported: callers import them from here
    "MIRROR_HINT",
    "TEST_CMD",
    "SweInstance",
    "SweResult",
    "SweScorer",
    "TaskSetError",
    "TaskSets",
    "check_mirrors",
    "held_out_paths",
    "interpret",
    "load_instances",
    "mirror_name",
    "repo_name",
]

log = structlog.get_logger()

DRIVER_DIR = ".dockyard-swe"
# The driver runs inside the sandbox as `python .dockyard-swe/run.py`; its source travels as a file.
DRIVER_SOURCE = (Path(__file__).with_name("swe_driver.py")).read_text()
EXIT_PATCH_FAILED = 10
EXIT_TEST_PATCH_FAILED = 11


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
    without a resolver is an ERROR (its environment is its image). `image_trees` (docker only,
    swe_image_trees.ImageTrees) makes the start tree and test patch of a row started from its image.
    A failure there is an ERROR verdict. `log_cap_bytes` (the service's output ceiling) is how much
    of the run's output is kept for grading; the request's `max_output_bytes` only caps what is returned.
    """

    def __init__(
        self,
        backend: SandboxBackend,
        task_sets: TaskSets,
        *,
        log_cap_bytes: int,
        checkout_root: str | None = None,
        image_for: ImageResolver | None = None,
        image_trees=None,
    ) -> None:
        self._backend = backend
        self.task_sets = task_sets
        self._log_cap_bytes = log_cap_bytes
        self._checkouts = Checkouts(checkout_root)
        self._image_for = image_for
        self._image_trees = image_trees

    def close(self) -> None:
        self._checkouts.close()
        if self._image_trees is not None:
            self._image_trees.close()

    async def prepare(self, task_set: str, instance: SweInstance) -> tuple[Path, str | None]:
        """(the start checkout, the image to run in): what a run, or a session, of `instance` starts from."""
        checkout, image, _ = await self._prepare(task_set, instance)
        return checkout, image

    async def _prepare(self, task_set: str, instance: SweInstance) -> tuple[Path, str | None, str]:
        """(checkout, image, the held-out test patch): a row started from its image gets both from it."""
        mirror = self.task_sets.mirror(task_set, instance.repo)
        prebuilt = instance.prebuilt
        if prebuilt is not None and (self._image_for is None or (prebuilt.start == "image" and not self._image_trees)):
            raise RuntimeError(
                f"instance {instance.instance_id!r} runs in its image {prebuilt.image!r}, which only "
                "the docker backend provides (DOCKYARD_SANDBOX_BACKEND=docker)"
            )
        if prebuilt is not None and prebuilt.start == "image":
            tree = await self._image_trees.for_instance(instance.instance_id, prebuilt)
            checkout, test_patch = tree.checkout, tree.test_patch
        else:
            checkout, test_patch = await self._checkouts.get(mirror, instance.base_commit), instance.test_patch
        return checkout, await self.image(task_set, instance), test_patch

    async def image(self, task_set: str, instance: SweInstance) -> str | None:
        """The image `instance` runs in (pulled and fitted, or built, once); None: the backend's own."""
        if self._image_for is None:
            return None
        return await self._image_for(instance, self.task_sets.mirror(task_set, instance.repo))

    async def prepare_images(self, task_set: str, instances: Sequence[SweInstance]) -> int:
        """Each instance's image made now, as its first run would, one after another (pulls and builds are
        the engine's work anyway); returns how many are ready. One that fails is logged and left to its
        first run, which reports it."""
        ready = 0
        for instance in instances:
            try:
                ready += await self.image(task_set, instance) is not None
            except Exception as exc:  # noqa: BLE001 -- its first run reports it, as without a preparation
                log.warning("an instance's image is not ready", instance=instance.instance_id, error=str(exc)[:300])
        return ready

    async def score(self, task_set: str, instance: SweInstance, patch: str, limits: ResourceLimits) -> SweResult:
        total = len(instance.fail_to_pass) + len(instance.pass_to_pass)
        try:
            touched = inspect_patch(patch)
        except PatchRefused as exc:
            return SweResult("patch_failed", tests_total=total, error_message=f"patch refused: {exc}")
        try:
            checkout, image, test_patch = await self._prepare(task_set, instance)
        except Exception as exc:  # any failure to prepare is the infrastructure's, never the policy's
            log.warning("swe preparation failed", instance=instance.instance_id, error=str(exc))
            return SweResult("error", tests_total=total, error_message=f"cannot prepare {instance.instance_id}: {exc}")
        try:
            test_paths = held_out_paths(test_patch)
        except PatchRefused as exc:
            return SweResult("error", tests_total=total, error_message=f"the instance's test_patch is unusable: {exc}")
        protected = protected_paths(touched, test_paths)
        nonce = secrets.token_hex(16)
        path = instance.prebuilt.env_bin if instance.prebuilt else ""
        spec = {"nonce": nonce, "test_cmd": instance.test_cmd, "test_files": test_paths, "path": path}
        files = {
            f"{DRIVER_DIR}/run.py": DRIVER_SOURCE,
            f"{DRIVER_DIR}/spec.json": json.dumps(spec),
            f"{DRIVER_DIR}/agent.patch": patch,
            f"{DRIVER_DIR}/test.patch": test_patch,
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
    if instance.expected_statuses:  # R2E-Gym: every test's status as expected, no FAIL_TO_PASS lists
        resolved, matches = swe_formats.grade_expected(statuses, instance.expected_statuses)
        return SweResult(
            "passed" if resolved else "failed",
            tests_passed=sum(matches.values()),
            fail_to_pass=matches,
            statuses=statuses,
            **common,
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
