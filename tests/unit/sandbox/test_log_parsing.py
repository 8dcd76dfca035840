"""Log parsing and grading are the swebench package's own, called through services/sandbox/log_parsing.py.

The logs come from running pytest for real on a module with every outcome: passes, failures
(with and without " - " messages), setup and teardown errors, skips, xfails, xpasses, parametrized
ids with spaces, slashes, brackets and dashes, class methods, printed output.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from swebench.harness import grading as swebench_grading
from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.log_parsers import python as swebench_parsers

from services.sandbox import log_parsing
from tests.conftest import REPO_ROOT

SAMPLE = r"""
import pytest

def test_pass():
    assert True

def test_fail():
    assert 1 == 2, "one - is not - two"

def test_fail_plain():
    raise ValueError("boom")

@pytest.fixture
def broken():
    raise RuntimeError("setup - broke")

def test_setup_error(broken):
    pass

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_teardown_error(broken_teardown):
    pass

@pytest.mark.skip(reason="not today")
def test_skip():
    pass

def test_skip_inside():
    pytest.skip("skipped - inside")

@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False

@pytest.mark.xfail(reason="fixed already")
def test_xpass():
    assert True

@pytest.mark.xfail(strict=True)
def test_xpass_strict():
    assert True

@pytest.mark.parametrize("value", [1, 2, "a b", "x/y", "/abs/path", "q-r", "[br]", "ünï"])
def test_param(value):
    assert value != 2

@pytest.mark.parametrize("a,b", [(1, 1), (2, 3)], ids=["same", "diff - ids"])
def test_ids(a, b):
    assert a == b

class TestClass:
    def test_method(self):
        print("PASSED looks like a status but is captured output")
        assert True

    @pytest.mark.parametrize("n", range(3))
    def test_method_param(self, n):
        assert n < 2
"""

OPTION_SETS = [
    ["-rA", "--tb=no", "-p", "no:cacheprovider"],
    ["-rA", "-p", "no:cacheprovider"],
    ["-rA", "-v", "--tb=short", "-p", "no:cacheprovider"],
    ["-rA", "--color=yes", "--tb=line", "-p", "no:cacheprovider"],
]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("pytest-logs")
    (root / "tests").mkdir()
    (root / "tests" / "test_sample.py").write_text(SAMPLE)
    (root / "tests" / "test_two.py").write_text("def test_other():\n    pass\n\ndef test_bad():\n    assert 0\n")
    out = []
    for options in OPTION_SETS:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *options, "tests"], cwd=root, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stdout[-2000:]  # some tests fail, as intended
        out.append(done.stdout + done.stderr)
    return out


@pytest.mark.parametrize(
    "name,reference",
    [
        ("parse_log_pytest", swebench_parsers.parse_log_pytest),
        ("pytest_options", swebench_parsers.parse_log_pytest_options),
        ("parse_log_pytest_v2", swebench_parsers.parse_log_pytest_v2),
    ],
)
def test_parse_log_is_swebenchs_parser(logs, name, reference, monkeypatch):
    for index, log in enumerate(logs):
        ours = log_parsing.parse_log(name, log)
        assert ours == reference(log, None)
        if index < 3 or name == "parse_log_pytest_v2":  # only v2 reads through colour codes
            assert len(ours) >= 20  # the log really has the outcomes
    # The call goes through swebench's registry, not a copy of it.
    seen = []
    key = log_parsing.ALIASES.get(name, name)
    monkeypatch.setitem(PARSER_REGISTRY, key, lambda log, spec: seen.append((log, spec.log_parser)) or {"t": "PASSED"})
    assert log_parsing.parse_log(name, "some log") == {"t": "PASSED"} and seen == [("some log", name)]


def test_parsed_statuses_are_the_real_outcomes(logs):
    statuses = log_parsing.parse_log("parse_log_pytest", logs[0])
    assert statuses["tests/test_sample.py::test_pass"] == "PASSED"
    assert statuses["tests/test_sample.py::test_fail"] == "FAILED"
    assert statuses["tests/test_sample.py::test_setup_error"] == "ERROR"
    assert statuses["tests/test_sample.py::test_xfail"] == "XFAIL"
    assert statuses["tests/test_sample.py::test_param[2]"] == "FAILED"
    assert statuses["tests/test_sample.py::TestClass::test_method_param[2]"] == "FAILED"
    assert statuses["tests/test_two.py::test_other"] == "PASSED"


def test_grading_is_swebenchs(logs):
    statuses = {**log_parsing.parse_log("pytest", logs[0]), "tests/test_sample.py::test_skip": "SKIPPED"}
    ok, bad, skip = (
        "tests/test_sample.py::test_pass",
        "tests/test_sample.py::test_fail",
        "tests/test_sample.py::test_skip",
    )
    xfail, gone = "tests/test_sample.py::test_xfail", "tests/test_sample.py::test_gone"
    assert log_parsing.grade(statuses, [ok, xfail], [skip]).resolved  # XFAIL passes, SKIPPED is kept
    for f2p, p2p in [([bad], [ok]), ([ok], [bad]), ([gone], []), ([skip], [])]:  # a missing or skipped F2P fails
        assert not log_parsing.grade(statuses, f2p, p2p).resolved, (f2p, p2p)
    rng = random.Random(0)
    ids = sorted(statuses) + [gone, "tests/test_sample.py::test_param[a b"]
    for _ in range(100):
        f2p, p2p = rng.sample(ids, rng.randint(0, 4)), rng.sample(ids, rng.randint(0, 6))
        ours = log_parsing.grade(statuses, f2p, p2p)
        report = swebench_grading.get_eval_tests_report(statuses, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
        assert (ours.fail_to_pass_success, ours.pass_to_pass_failure) == (
            report[FAIL_TO_PASS]["success"],
            report[PASS_TO_PASS]["failure"],
        )
        assert ours.resolved == (swebench_grading.get_resolution_status(report) == "RESOLVED_FULL")


def test_unknown_parser_is_named():
    with pytest.raises(KeyError, match="parse_log_pytest_v2"):
        log_parsing.parse_log("nope", "")
    with pytest.raises(ValueError, match="parse_log_junit.*PARSER_REGISTRY"):
        log_parsing.parser_for("parse_log_junit", "o/r")


def test_parser_names_and_repository_defaults_are_swebenchs():
    for name in ("parse_log_django", "parse_log_sympy", "parse_log_gotest"):  # swebench's, whatever the language
        assert log_parsing.parser_for(name, "o/r") == name
    for repo, parser in swebench_parsers.MAP_REPO_TO_PARSER_PY.items():
        assert PARSER_REGISTRY[log_parsing.parser_for(None, repo)] is parser
    assert log_parsing.parser_for(None, "o/r") == "parse_log_pytest"


def test_a_sandbox_worker_starts_without_importing_swebench() -> None:
    # swebench pulls in `datasets` (seconds of import): only a worker that grades an instance pays it.
    names = ("services.sandbox.log_parsing", "swebench", "datasets")
    code = f"import sys, services.sandbox.servicer; print([m in sys.modules for m in {names}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    assert out.strip() == "[True, False, False]"  # the servicer loads this module, not what it wraps
    assert log_parsing.parser_for(None, "psf/requests") in PARSER_REGISTRY  # and it loads when asked
