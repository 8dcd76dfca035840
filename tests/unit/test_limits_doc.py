"""docs/limits.md is the one table of request limits: every number it states is the code's own.

A row whose limit cell holds plain numbers names, in its last column, the constant that enforces
it; the constant's value (or, for a range, its upper end) must be among the row's numbers.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "limits.md"
ROW = re.compile(r"^\| (\S[^|]*) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| `([\w.]+)` \|$", re.MULTILINE)


def _constant(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_row_names_a_constant_the_code_has() -> None:
    rows = ROW.findall(DOC.read_text())
    assert len(rows) >= 30
    for *_, dotted in rows:
        _constant(dotted)  # raises if the code has no such thing


def test_every_numeric_limit_is_the_constant_it_names() -> None:
    checked = 0
    for _, _, limit, _, dotted in ROW.findall(DOC.read_text()):
        value = _constant(dotted)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        numbers = {int(n) for n in re.findall(r"(?<![\w*.])\d+(?![\w*])", limit)}
        assert value in numbers, f"{dotted} is {value}; docs/limits.md says {limit!r}"
        checked += 1
    assert checked >= 25
