"""Scoring a Harbor task's session: its tests/test.sh run after the agent, the reward it writes read back.

    ScoreSession (after the agent) ──score──> tests/* as a tar into /tests (a fresh folder), /logs/verifier
                                              emptied (both links into /tmp: terminal_images.py)
        ──> `cd WORKDIR && env <[verifier].env> bash /tests/test.sh`, at most verifier.timeout_sec
        ──> /logs/verifier/reward.json ("reward" key), else reward.txt ──harbor.parse_reward──> r in [0, 1]
        ──> SweResult: PASSED iff r == 1; tests_passed / tests_total = r as a fraction (env.reward
            all_pass: r == 1; pass_fraction: r)

Guarantees: the tests and the verifier folder reach the session only once the agent has finished, both
emptied first (no reward the agent wrote is read); the verdict comes from the reward file, never from
test.sh's exit code; a missing or unreadable reward file, or a reward outside [0, 1], is FAILED with
the reason (the agent's actions can cause it); a run past verifier.timeout_sec is a TIMEOUT; only an
infrastructure failure (the container gone, the tests not copied in) is an ERROR, masked from training.
"""

from __future__ import annotations

import io
import json
import shlex
import tarfile
from fractions import Fraction

from dockyard.tasks.harbor import CONTAINER_VERIFIER_DIR, HarborTask, parse_reward
from dockyard.tasks.terminal import CONTAINER_TEST_DIR
from services.sandbox.backend import ResourceLimits, SessionHandle, Status
from services.sandbox.swe import SweResult
from services.sandbox.terminal import error, run_test_script
from services.sandbox.terminal_images import LOGS_ROOT, LOGS_TARGET, TESTS_TARGET

# Prints {"json": reward.json's text or null, "txt": reward.txt's text or null}.
_READ_REWARD = (
    "import json, pathlib, sys\n"
    "d = pathlib.Path(sys.argv[1])\n"
    "read = lambda n: (d / n).read_text(errors='replace') if (d / n).is_file() else None\n"
    "print(json.dumps({'json': read('reward.json'), 'txt': read('reward.txt')}))\n"
)
_DENOMINATOR = 1_000_000  # a reward's resolution in tests_passed / tests_total


def tests_archive(task: HarborTask) -> bytes:
    """The contents of tests/ at the archive's top (as /tests holds them)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(task.test_dir.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(task.test_dir)), recursive=False)
    return buffer.getvalue()


def _fresh_folders() -> list[str]:
    verifier = LOGS_TARGET + CONTAINER_VERIFIER_DIR.removeprefix(LOGS_ROOT)
    return [
        "sh",
        "-c",
        f"rm -rf {TESTS_TARGET} {LOGS_TARGET} && mkdir -p {TESTS_TARGET} {verifier} && tar -x -f - -C {TESTS_TARGET}",
    ]


async def score(
    handle: SessionHandle, task: HarborTask, workdir: str, limits: ResourceLimits, *, max_timeout: float, log_cap: int
) -> SweResult:
    """Copy the tests in, run test.sh at most verifier.timeout_sec (under `max_timeout`), read the reward."""
    env = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(task.config.verifier.env.items()))
    outcome = await run_test_script(
        handle,
        (_fresh_folders(), tests_archive(task)),
        ["bash", "-c", f"cd {workdir} && env {env} bash {CONTAINER_TEST_DIR}/test.sh"],
        limits,
        script="tests/test.sh",
        timeout=("verifier.timeout_sec", task.config.verifier.timeout_sec),
        max_timeout=max_timeout,
        log_cap=log_cap,
    )
    if isinstance(outcome, SweResult):
        return outcome
    read = await handle.exec(["python3", "-I", "-c", _READ_REWARD, CONTAINER_VERIFIER_DIR], None, limits)
    if read.status is not Status.PASSED:
        return error(f"the reward file could not be read: {read.error_message or read.stderr}", outcome)
    files = json.loads(read.stdout)
    try:
        reward = parse_reward(files["json"], files["txt"])
    except ValueError as exc:
        return SweResult(status="failed", outcome=outcome, error_message=f"{exc}: unresolved")
    if not 0.0 <= reward <= 1.0:
        message = f"tests/test.sh wrote the reward {reward!r}, outside [0, 1]: unresolved"
        return SweResult(status="failed", outcome=outcome, error_message=message)
    share = Fraction(reward).limit_denominator(_DENOMINATOR)
    return SweResult(
        status="passed" if reward == 1.0 else "failed",
        tests_passed=share.numerator,
        tests_total=share.denominator,
        outcome=outcome,
    )
