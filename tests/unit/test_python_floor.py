"""The declared Python floor is true: pyproject's requires-python, ruff's target and the interpreter CI runs.

The code uses 3.11's standard library (tomllib, asyncio.timeout, datetime.UTC), so the floor says 3.11;
CI (CI=1) runs on the floor itself, so nothing newer slips in unnoticed.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floor() -> tuple[int, int]:
    specifier = SpecifierSet(PYPROJECT["project"]["requires-python"])
    (floor,) = [Version(s.version) for s in specifier if s.operator == ">="]
    return floor.major, floor.minor


def test_the_floor_is_the_oldest_python_the_code_can_run_on() -> None:
    assert _floor() == (3, 11), f"requires-python says {_floor()}: the code needs 3.11 (tomllib, asyncio.timeout)"


def test_ruff_targets_the_floor() -> None:
    major, minor = _floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"


def test_the_interpreter_meets_the_floor_and_ci_runs_on_it() -> None:
    assert sys.version_info[:2] >= _floor()
    if os.environ.get("CI"):
        assert sys.version_info[:2] == _floor(), f"CI runs Python {sys.version_info[:2]}, not the floor {_floor()}"
