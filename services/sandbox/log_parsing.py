"""Test logs -> per-test statuses -> SWE-bench grading, with the `swebench` package's semantics.

    instance's log_parser (ours, swebench's name, or none: by repo) ──parser_for──> parser
    test log ──parse_log(parser, log)──> {test id: PASSED|FAILED|SKIPPED|ERROR|XFAIL}
             ──grade(statuses, FAIL_TO_PASS, PASS_TO_PASS)──> Grade (resolved, per-list results)

Guarantees: for the parsers named in PARSERS, `parse_log` returns the same mapping as
swebench 5.0.2's `harness/log_parsers/python.py` on the same log, and `grade` the same
success/failure split and resolution as its `harness/grading.py` (PASS_AND_FAIL evaluation):
a FAIL_TO_PASS test passes when PASSED or XFAIL; a PASS_TO_PASS test is kept when PASSED,
XFAIL or SKIPPED; a test missing from the log fails; an expected id truncated inside its
parameter brackets matches by prefix when every candidate agrees on pass-versus-fail.
`parser_for` takes swebench's parser names and, for an instance that names none, its repository's
parser as swebench picks it; a parser this module lacks (django's, sympy's, ...) is refused, never
replaced by another. `tests/unit/sandbox/test_log_parsing.py` checks the agreement on real pytest
logs and the name maps against swebench's. The module has no
dependency on swebench at run time.

What it does not cover: the parsers read pytest's `-rA` summary lines, so code under test that
prints a line such as `PASSED tests/x.py::test_y` into the log can add a status; SWE-bench has the
same exposure. The integrity check (a patch may not touch test files) is what keeps a patch from
installing a conftest.py that rewrites reports.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)  # the order in which line prefixes are tried

_SKIP_COUNT = re.compile(r"^\[\d+\]$")
_ANSI_COLOUR = re.compile(r"\[(\d+)m")
_CONTROL = str.maketrans("", "", "".join(chr(c) for c in range(1, 32)))
_PARAMETRIZED = re.compile(r"(.*?)\[(.*)\]")


def _status_prefix(line: str) -> str | None:
    return next((s for s in STATUSES if line.startswith(s)), None)


def _is_skip_count(status: str, name: str) -> bool:
    # "SKIPPED [2] tests/x.py:10: reason" summarises skips; "[2]" is not a test id.
    return status == SKIPPED and bool(_SKIP_COUNT.match(name))


def parse_pytest(log: str) -> dict[str, str]:
    """`pytest -rA` summary lines ("STATUS test-id [- message]"); the last line for an id wins."""
    statuses: dict[str, str] = {}
    for line in log.split("\n"):
        status = _status_prefix(line)
        if status is None:
            continue
        if line.startswith(FAILED):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) <= 1 or _is_skip_count(words[0], words[1]):
            continue
        statuses[words[1]] = words[0]
    return statuses


def parse_pytest_options(log: str) -> dict[str, str]:
    """Like parse_pytest; a parameter that is an absolute path keeps only its last component."""
    statuses: dict[str, str] = {}
    for line in log.split("\n"):
        if _status_prefix(line) is None:
            continue
        if line.startswith(FAILED):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) <= 1 or _is_skip_count(words[0], words[1]):
            continue
        name = words[1]
        match = _PARAMETRIZED.search(name)
        if match:
            head, option = match.groups()
            if option.startswith("/") and not option.startswith("//") and "*" not in option:
                option = "/" + option.split("/")[-1]
            name = f"{head}[{option}]"
        statuses[name] = words[0]
    return statuses


def parse_pytest_v2(log: str) -> dict[str, str]:
    """Colour codes and control characters stripped; ids may contain spaces; trailing statuses too."""
    statuses: dict[str, str] = {}
    for raw in log.split("\n"):
        line = _ANSI_COLOUR.sub("", raw).translate(_CONTROL)
        if _status_prefix(line) is not None:
            if line.startswith(FAILED):
                line = line.split(" - ", 1)[0]
            words = line.split()
            if len(words) >= 2 and not _is_skip_count(words[0], words[1]):
                statuses[" ".join(words[1:])] = words[0]
        elif any(line.endswith(s) for s in STATUSES):  # older pytest: "test-id STATUS"
            words = line.split()
            if len(words) >= 2:
                statuses[" ".join(words[:-1])] = words[-1]
    return statuses


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest,
    "pytest_options": parse_pytest_options,
    "pytest_v2": parse_pytest_v2,
}


# swebench's parser names (harness/log_parsers) -> PARSERS keys; swebench's others are not supported.
SWEBENCH_PARSERS = {
    "parse_log_pytest": "pytest",
    "parse_log_pytest_options": "pytest_options",
    "parse_log_pytest_v2": "pytest_v2",
}
# swebench 5.0.2's MAP_REPO_TO_PARSER_PY: what an instance of these repositories needs when it names none.
REPO_PARSERS = {
    "astropy/astropy": "parse_log_pytest_v2",
    "django/django": "parse_log_django",
    "marshmallow-code/marshmallow": "parse_log_pytest",
    "matplotlib/matplotlib": "parse_log_matplotlib",
    "mwaskom/seaborn": "parse_log_seaborn",
    "pallets/flask": "parse_log_pytest",
    "psf/requests": "parse_log_pytest_options",
    "pvlib/pvlib-python": "parse_log_pytest",
    "pydata/xarray": "parse_log_pytest",
    "pydicom/pydicom": "parse_log_pytest_options",
    "pylint-dev/astroid": "parse_log_pytest",
    "pylint-dev/pylint": "parse_log_pytest_options",
    "pytest-dev/pytest": "parse_log_pytest",
    "pyvista/pyvista": "parse_log_pytest",
    "scikit-learn/scikit-learn": "parse_log_pytest_v2",
    "sqlfluff/sqlfluff": "parse_log_pytest",
    "sphinx-doc/sphinx": "parse_log_pytest_v2",
    "sympy/sympy": "parse_log_sympy",
}


def parser_for(name: str | None, repo: str) -> str:
    """An instance's `log_parser` (a PARSERS key or swebench's name; None: the repository's, else
    pytest) -> a PARSERS key; ValueError for a parser this module does not have."""
    named = REPO_PARSERS.get(repo, "pytest") if name is None else str(name)
    key = SWEBENCH_PARSERS.get(named, named)
    if key not in PARSERS:
        why = "" if name is not None else f" (swebench's parser for {repo}; the instance names none)"
        raise ValueError(
            f"log_parser {named!r}{why} is not supported; supported: {sorted(PARSERS)} or swebench's "
            f"{sorted(SWEBENCH_PARSERS)}"
        )
    return key


def parse_log(parser: str, log: str) -> dict[str, str]:
    """Statuses by test id; KeyError names the known parsers."""
    try:
        return PARSERS[parser](log)
    except KeyError:
        raise KeyError(f"unknown log parser {parser!r}; known: {sorted(PARSERS)}") from None


def _lookup(test: str, statuses: dict[str, str]) -> str | None:
    """The status-map key for `test`; a parametrized id cut short inside '[' matches by prefix."""
    if test in statuses:
        return test
    if test.count("[") > test.count("]"):
        candidates = [key for key in statuses if key.startswith(test)]
        if candidates and len({statuses[key] in (PASSED, XFAIL) for key in candidates}) == 1:
            return candidates[0]
    return None


def passed(test: str, statuses: dict[str, str]) -> bool:
    key = _lookup(test, statuses)
    return key is not None and statuses[key] in (PASSED, XFAIL)


def maintained(test: str, statuses: dict[str, str]) -> bool:
    """PASS_TO_PASS: a skipped test is not a regression."""
    key = _lookup(test, statuses)
    return key is not None and statuses[key] in (PASSED, XFAIL, SKIPPED)


def failed(test: str, statuses: dict[str, str]) -> bool:
    """Missing, FAILED, ERROR or SKIPPED. A status that is none of the five counts neither way."""
    key = _lookup(test, statuses)
    return key is None or statuses[key] in (FAILED, ERROR, SKIPPED)


@dataclass(frozen=True)
class Grade:
    fail_to_pass_success: list[str] = field(default_factory=list)
    fail_to_pass_failure: list[str] = field(default_factory=list)
    pass_to_pass_success: list[str] = field(default_factory=list)
    pass_to_pass_failure: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> bool:
        """Every FAIL_TO_PASS test passes and every PASS_TO_PASS test is kept."""
        return not self.fail_to_pass_failure and not self.pass_to_pass_failure

    @property
    def tests_passed(self) -> int:
        return len(self.fail_to_pass_success) + len(self.pass_to_pass_success)

    @property
    def tests_total(self) -> int:
        return self.tests_passed + len(self.fail_to_pass_failure) + len(self.pass_to_pass_failure)


def grade(statuses: dict[str, str], fail_to_pass: Iterable[str], pass_to_pass: Iterable[str]) -> Grade:
    """Split the two lists into successes and failures (a missing test is a failure)."""
    f2p, p2p = list(fail_to_pass), list(pass_to_pass)
    return Grade(
        fail_to_pass_success=[t for t in f2p if passed(t, statuses)],
        fail_to_pass_failure=[t for t in f2p if not passed(t, statuses) and failed(t, statuses)],
        pass_to_pass_success=[t for t in p2p if maintained(t, statuses)],
        pass_to_pass_failure=[t for t in p2p if not maintained(t, statuses) and failed(t, statuses)],
    )
