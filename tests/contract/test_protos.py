"""The protos are a contract: buf STANDARD lint is clean and committed stubs match them."""

from __future__ import annotations

import filecmp
import runpy
import subprocess
from pathlib import Path

from tests.conftest import REPO_ROOT, require_tool

generate = runpy.run_path(str(REPO_ROOT / "protos" / "generate.py"))["generate"]


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert written, "no stubs generated"
    drift = [
        str(path.relative_to(tmp_path))
        for path in written
        if not filecmp.cmp(path, REPO_ROOT / path.relative_to(tmp_path), shallow=False)
    ]
    assert not drift, f"stubs differ from the protos; run `make protos`: {drift}"


def test_buf_lint_standard_is_clean() -> None:
    buf = require_tool(REPO_ROOT / ".tools" / "node_modules" / ".bin" / "buf", "buf")
    result = subprocess.run([buf, "lint"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_has_one_package_per_version() -> None:
    protos = sorted((REPO_ROOT / "protos" / "dockyard").glob("*/v1/*.proto"))
    packages = {p.parent.parent.name for p in protos}
    assert packages == {"common", "coordinator", "trainer", "rollout", "buffer", "sandbox"}
    for proto in protos:
        name = proto.parent.parent.name
        assert f"package dockyard.{name}.v1;" in proto.read_text()
