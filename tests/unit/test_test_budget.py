"""The suite's time budget is watched: no test runs past ten minutes unless a comment says why.

pytest-timeout fails any test past the default (pyproject's `timeout`, 600 s); a test that needs more
raises its own limit with `pytest.mark.timeout(N)`, and that line (or the comment lines right above it)
must say why it cannot be smaller. .ci/run prints each phase's time and the slowest tests.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEN_MINUTES = 600
TIMEOUT_MARK = re.compile(r"pytest\.mark\.timeout\((\d+)\)")


def test_the_default_limit_is_ten_minutes() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert int(options["timeout"]) == TEN_MINUTES


def _has_reason(lines: list[str], index: int) -> bool:
    """A comment after the mark on its line, or a comment line right above it."""
    after = lines[index].split("pytest.mark.timeout", 1)[1]
    return "#" in after or (index > 0 and lines[index - 1].lstrip().startswith("#"))


def test_every_limit_past_ten_minutes_says_why() -> None:
    unexplained = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            for seconds in TIMEOUT_MARK.findall(line):
                if int(seconds) > TEN_MINUTES and not _has_reason(lines, index):
                    unexplained.append(f"{path.relative_to(ROOT)}:{index + 1}: timeout({seconds})")
    assert not unexplained, "a test allowed past ten minutes needs a comment saying why:\n" + "\n".join(unexplained)
