"""Test logs -> per-test statuses -> SWE-bench grading, by the `swebench` package's own code.

    instance's log_parser (swebench's name, a short alias, or none: by repo) ──parser_for──> name
    test log ──parse_log(name, log)──> swebench.harness.log_parsers.PARSER_REGISTRY[name](log, spec)
             ──> {test id: PASSED|FAILED|SKIPPED|ERROR|XFAIL}
             ──grade(statuses, FAIL_TO_PASS, PASS_TO_PASS)──> swebench.harness.grading
                 get_eval_tests_report + get_resolution_status ──> Grade

Guarantees: every parser and every grading rule is swebench's (a runtime dependency, pinned in
pyproject.toml), called as it is; this module only names them and keeps the results in a small
dataclass. `parser_for` takes any name in swebench's PARSER_REGISTRY (or `pytest`,
`pytest_options`, `pytest_v2` for the three pytest parsers) and, for an instance that names
none, its repository's parser from swebench's MAP_REPO_TO_PARSER_PY, `parse_log_pytest` for any
other repository; an unknown name is refused (ValueError naming the known ones), never replaced
by another. Resolved means RESOLVED_FULL: every FAIL_TO_PASS test passes (PASSED or XFAIL) and
every PASS_TO_PASS test is kept (PASSED, XFAIL or SKIPPED); a test missing from the log fails.

What it does not cover: the pytest parsers read pytest's `-rA` summary lines, so code under test
that prints a line such as `PASSED tests/x.py::test_y` into the log can add a status; SWE-bench
has the same exposure. The integrity check (a patch may not touch test files) is what keeps a
patch from installing a conftest.py that rewrites reports.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace

DEFAULT_PARSER = "parse_log_pytest"
# Short names task sets built before this module used swebench directly still carry.
ALIASES = {
    "pytest": "parse_log_pytest",
    "pytest_options": "parse_log_pytest_options",
    "pytest_v2": "parse_log_pytest_v2",
}


@functools.cache
def _swebench() -> SimpleNamespace:
    """swebench's harness, imported at first use: importing it takes seconds (it pulls in datasets),
    which a sandbox worker that never grades an SWE-bench instance should not pay at start."""
    from swebench.harness import grading
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, ResolvedStatus
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
    from swebench.types import TestSpec

    return SimpleNamespace(
        grading=grading,
        FAIL_TO_PASS=FAIL_TO_PASS,
        PASS_TO_PASS=PASS_TO_PASS,
        ResolvedStatus=ResolvedStatus,
        PARSER_REGISTRY=PARSER_REGISTRY,
        MAP_REPO_TO_PARSER_PY=MAP_REPO_TO_PARSER_PY,
        TestSpec=TestSpec,
    )


def parser_for(name: str | None, repo: str) -> str:
    """An instance's `log_parser` (None: its repository's, as swebench picks it) -> a PARSER_REGISTRY name."""
    sb = _swebench()
    if name is None:
        parser = sb.MAP_REPO_TO_PARSER_PY.get(repo)
        return parser.__name__ if parser is not None else DEFAULT_PARSER
    named = ALIASES.get(str(name), str(name))
    if named not in sb.PARSER_REGISTRY:
        raise ValueError(
            f"log_parser {name!r} is not one of swebench's parsers; use a name of "
            f"swebench.harness.log_parsers.PARSER_REGISTRY (e.g. parse_log_pytest) or one of {sorted(ALIASES)}"
        )
    return named


def parse_log(parser: str, log: str, *, repo: str = "", instance_id: str = "") -> dict[str, str]:
    """Statuses by test id, from swebench's parser `parser`; KeyError for a name it does not have."""
    sb = _swebench()
    try:
        function = sb.PARSER_REGISTRY[ALIASES.get(parser, parser)]
    except KeyError:
        raise KeyError(f"unknown log parser {parser!r}; swebench has {sorted(sb.PARSER_REGISTRY)}") from None
    spec = sb.TestSpec(instance_id, "", [], repo, "", [], [], log_parser=parser)
    return function(log, spec)


@dataclass(frozen=True)
class Grade:
    fail_to_pass_success: list[str] = field(default_factory=list)
    fail_to_pass_failure: list[str] = field(default_factory=list)
    pass_to_pass_success: list[str] = field(default_factory=list)
    pass_to_pass_failure: list[str] = field(default_factory=list)
    resolved: bool = False  # swebench's RESOLVED_FULL

    @property
    def tests_passed(self) -> int:
        return len(self.fail_to_pass_success) + len(self.pass_to_pass_success)


def grade(statuses: dict[str, str], fail_to_pass: Iterable[str], pass_to_pass: Iterable[str]) -> Grade:
    """swebench's PASS_AND_FAIL report of the two lists against `statuses`, and its resolution."""
    sb = _swebench()
    f2p, p2p = sb.FAIL_TO_PASS, sb.PASS_TO_PASS
    report = sb.grading.get_eval_tests_report(statuses, {f2p: list(fail_to_pass), p2p: list(pass_to_pass)})
    return Grade(
        fail_to_pass_success=report[f2p]["success"],
        fail_to_pass_failure=report[f2p]["failure"],
        pass_to_pass_success=report[p2p]["success"],
        pass_to_pass_failure=report[p2p]["failure"],
        resolved=sb.grading.get_resolution_status(report) == sb.ResolvedStatus.FULL.value,
    )
