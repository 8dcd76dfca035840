"""The protobuf floor in pyproject.toml is the gencode version of the committed stubs.

A stub refuses a runtime older than the protoc that generated it ("Runtime version cannot be
older than the linked gencode version"), so an install that honours a lower floor fails at import.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]
VALIDATE = re.compile(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),")


def _gencode_versions() -> dict[Path, Version]:
    versions = {}
    for stub in sorted((ROOT / "dockyard" / "api").rglob("*_pb2.py")):
        found = VALIDATE.search(stub.read_text())
        assert found, f"{stub}: no ValidateProtobufRuntimeVersion call"
        versions[stub] = Version(".".join(found.groups()))
    return versions


def _floor() -> Version:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "protobuf"]
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    assert floors, f"protobuf has no >= floor in pyproject.toml: {requirement}"
    return max(floors)


def test_the_protobuf_floor_is_the_stubs_gencode_version() -> None:
    versions = _gencode_versions()
    assert versions, "no generated stubs under dockyard/api"
    newest = max(versions.values())
    assert _floor() == newest, (
        f"pyproject.toml requires protobuf>={_floor()} but the stubs are gencode {newest}: "
        "set the floor to the gencode version (or regenerate the stubs for the floor)"
    )
