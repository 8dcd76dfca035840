"""HumanEval through the sandbox service: all 164 canonical solutions pass, wrong ones do not.

Wrong ones: every canonical body replaced by `return None`, and, for a seeded sample, the
canonical body with one comparison operator flipped (checked against a bare interpreter run).

Scored exactly as the program_synthesis environment scores a completion (dockyard.tasks.envs),
over gRPC against a real sandbox server. The same 2 x 164 short runs go through
the local and the docker backend.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.rpc.client import connect
from dockyard.tasks import humaneval
from dockyard.tasks.envs import Environment
from services.sandbox.task_builder import mutations

pytestmark = pytest.mark.slow

SANDBOX_BACKENDS = ["local", "docker"]
LIMITS = sandbox_pb2.Limits(timeout_seconds=20, memory_mb=1024, cpu_seconds=20)


@pytest.fixture(params=SANDBOX_BACKENDS)
def sandbox_backend_kind(request) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_sandbox_image")  # built once per session; required under CI=1
    return request.param


# The canonical body replaced by one that returns nothing.
WRONG_BODY = "    return None\n"


def test_canonical_solutions_resolve_and_wrong_ones_do_not(start_service, sandbox_backend_kind):
    service = start_service(
        "sandbox", {"DOCKYARD_SANDBOX_BACKEND": sandbox_backend_kind, "DOCKYARD_SANDBOX_MAX_CONCURRENCY": "2"}
    )
    problems = humaneval.load_problems()
    assert len(problems) == 164
    env = Environment("program_synthesis")

    async def main() -> tuple[dict[str, common_pb2.Verdict], dict[str, common_pb2.Verdict]]:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            gate = asyncio.Semaphore(4)

            async def one(problem: humaneval.Problem, completion: str) -> common_pb2.Verdict:
                async with gate:
                    return await env.score(stub, humaneval.task_of(problem), completion, problem.task_id, LIMITS)

            canonical = await asyncio.gather(*(one(p, p.canonical_solution) for p in problems))
            wrong = await asyncio.gather(*(one(p, WRONG_BODY) for p in problems))
        names = [p.task_id for p in problems]
        return dict(zip(names, canonical, strict=True)), dict(zip(names, wrong, strict=True))

    canonical, wrong = asyncio.run(main())
    not_passed = {
        k: (v.status, v.stderr[-300:]) for k, v in canonical.items() if v.status != common_pb2.VERDICT_STATUS_PASSED
    }
    assert not not_passed
    passed_wrong = [k for k, v in wrong.items() if v.status == common_pb2.VERDICT_STATUS_PASSED]
    assert not passed_wrong
    assert all(v.status == common_pb2.VERDICT_STATUS_FAILED and v.tests_passed == 0 for v in wrong.values())


def mutant_of(problem: humaneval.Problem, folder: Path) -> str | None:
    """The canonical body with one comparison operator flipped, or None if it has none to flip."""
    source = problem.prompt + problem.canonical_solution
    (folder / "solution.py").write_text(source)
    body_start = problem.prompt.count("\n") + 1
    found = [m for m in mutations(folder, "solution.py") if m.lineno >= body_start]
    if not found:
        return None
    m = found[0]
    lines = source.splitlines(keepends=True)
    lines[m.lineno - 1] = m.after
    return "".join(lines)[len(problem.prompt) :]


def test_mutated_solutions_get_the_verdict_a_plain_run_gives(start_service, sandbox_backend_kind, tmp_path):
    """Differential: for canonical solutions with one operator flipped, the sandbox agrees with
    running the same program and tests in a bare interpreter, and most mutants are caught."""
    service = start_service("sandbox", {"DOCKYARD_SANDBOX_BACKEND": sandbox_backend_kind})
    problems = random.Random(0).sample(humaneval.load_problems(), 40)
    cases = [(p, c) for p in problems if (c := mutant_of(p, tmp_path)) is not None]
    assert len(cases) >= 20
    env = Environment("program_synthesis")

    def plain_run(problem: humaneval.Problem, completion: str) -> bool:
        program = humaneval.program_for(problem.prompt, completion) + humaneval.tests_for(problem)[0]
        return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60).returncode == 0

    async def main() -> list[common_pb2.Verdict]:
        async with connect(service.address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            return [await env.score(stub, humaneval.task_of(p), c, p.task_id, LIMITS) for p, c in cases]

    verdicts = asyncio.run(main())
    expected = [plain_run(p, c) for p, c in cases]
    got = [v.status == common_pb2.VERDICT_STATUS_PASSED for v in verdicts]
    assert got == expected
    assert sum(got) <= len(got) // 4  # a flipped comparison breaks most solutions
