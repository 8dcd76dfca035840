"""GPU-only tests: collected only when asked for by path (`make test-gpu`, `pytest tests/gpu`).

`make test` (pytest over testpaths, i.e. `tests`) leaves this folder out, since the machines that run it
have no GPU; a run that names this folder and finds no CUDA fails under CI=1 and skips loudly otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == Path(__file__):
        return None
    asked = any(Path(str(arg).split("::")[0]).resolve().is_relative_to(HERE) for arg in config.args)
    return None if asked else True
