"""Our pytest log parsers and grading agree with the swebench package's on real pytest logs.

The logs come from running pytest for real on a module with every outcome: passes, failures
(with and without " - " messages), setup and teardown errors, skips, xfails, xpasses, parametrized
ids with spaces, slashes, brackets and dashes, class methods, printed output. swebench (a dev
dependency) is imported here only, never by the service.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from swebench.harness import grading as swebench_grading
from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS
from swebench.harness.log_parsers import python as swebench_parsers

from services.sandbox import log_parsing

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
        ("pytest", swebench_parsers.parse_log_pytest),
        ("pytest_options", swebench_parsers.parse_log_pytest_options),
        ("pytest_v2", swebench_parsers.parse_log_pytest_v2),
    ],
)
def test_parsers_agree_with_swebench(logs, name, reference):
    for index, log in enumerate(logs):
        ours = log_parsing.parse_log(name, log)
        assert ours == reference(log, None)
        if index < 3 or name == "pytest_v2":  # only v2 reads through colour codes
            assert len(ours) >= 20  # the log really has the outcomes
    plain = log_parsing.parse_log(name, logs[0])
    # -rA reports skips as "SKIPPED [n] file:line: reason": no test id, so no SKIPPED entry.
    assert set(plain.values()) == {"PASSED", "FAILED", "ERROR", "XFAIL"}


def test_parsed_statuses_are_the_real_outcomes(logs):
    statuses = log_parsing.parse_pytest(logs[0])
    assert statuses["tests/test_sample.py::test_pass"] == "PASSED"
    assert statuses["tests/test_sample.py::test_fail"] == "FAILED"
    assert statuses["tests/test_sample.py::test_setup_error"] == "ERROR"
    assert statuses["tests/test_sample.py::test_xfail"] == "XFAIL"
    assert statuses["tests/test_sample.py::test_param[2]"] == "FAILED"
    assert statuses["tests/test_sample.py::TestClass::test_method_param[2]"] == "FAILED"
    assert statuses["tests/test_two.py::test_other"] == "PASSED"


def test_grading_agrees_with_swebench(logs):
    rng = random.Random(0)
    for log in logs[:3]:
        # Plus a SKIPPED entry (what `-rA` never names, other parsers do) to cover its grading rule.
        statuses = {**log_parsing.parse_pytest(log), "tests/test_sample.py::test_skip": "SKIPPED"}
        ids = sorted(statuses)
        # Missing tests, and ids cut short inside their parameter brackets, as SWE-bench has them.
        extra = [
            "tests/test_sample.py::test_gone",
            "tests/test_sample.py::test_param[a b",
            "tests/test_sample.py::test_ids[d",
        ]
        for _ in range(200):
            f2p = rng.sample(ids + extra, rng.randint(0, 4))
            p2p = rng.sample(ids + extra, rng.randint(0, 6))
            ours = log_parsing.grade(statuses, f2p, p2p)
            report = swebench_grading.get_eval_tests_report(statuses, {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p})
            assert ours.fail_to_pass_success == report[FAIL_TO_PASS]["success"]
            assert ours.fail_to_pass_failure == report[FAIL_TO_PASS]["failure"]
            assert ours.pass_to_pass_success == report[PASS_TO_PASS]["success"]
            assert ours.pass_to_pass_failure == report[PASS_TO_PASS]["failure"]
            full = swebench_grading.get_resolution_status(report) == "RESOLVED_FULL"
            assert ours.resolved == full, (f2p, p2p)


def test_unknown_parser_is_named():
    with pytest.raises(KeyError, match="pytest_v2"):
        log_parsing.parse_log("nope", "")


def test_swebench_names_map_to_the_same_parsers():
    for name, key in log_parsing.SWEBENCH_PARSERS.items():
        assert getattr(swebench_parsers, name).__name__ == name and key in log_parsing.PARSERS
        assert log_parsing.parser_for(name, "o/r") == key
    mapped = {repo: parser.__name__ for repo, parser in swebench_parsers.MAP_REPO_TO_PARSER_PY.items()}
    assert log_parsing.REPO_PARSERS == mapped
    assert log_parsing.parser_for(None, "o/r") == "pytest"
    with pytest.raises(ValueError, match=r"parse_log_sympy.*sympy/sympy"):
        log_parsing.parser_for(None, "sympy/sympy")
