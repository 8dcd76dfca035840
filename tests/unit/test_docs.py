"""docs/configuration.md documents every job-config field and every service setting.

Conventions the page follows, and these tests check:

- Every section of MasterConfig (a field whose type is a pydantic model, Optional ones such as
  ``policy.bootstrap`` included) has a heading ``### `dotted.path` ``.
- Every other field has a table row ``| `dotted.path` | default | meaning |``. The default cell
  is ``required`` for a field without a default, otherwise the default in backticks, written as
  ``render`` below writes it. Defaults are the effective ones: ``data.validation.size`` is 64
  because the ``data.validation`` section's own default says so.
- Every field of every service's settings class has a row
  ``| `DOCKYARD_<SERVICE>_<FIELD>` | default | meaning |``, with the default in backticks
  (except machine-dependent defaults, listed in MACHINE_DEPENDENT); the settings every service
  shares (``dockyard.rpc.auth.AuthSettings``, ``DOCKYARD_<FIELD>``) sit under ``### Shared``.
- No row names a field or variable that the code does not have.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings

from dockyard.config.reference import REQUIRED, render, sections
from dockyard.experience.data_plane import DataPlaneSettings
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.settings import DEFAULT_PORTS, ServiceSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*?)\s*\|", re.MULTILINE)
HEADING = re.compile(r"^#{2,4}\s+`([^`]+)`\s*$", re.MULTILINE)
MACHINE_DEPENDENT = {"DOCKYARD_SANDBOX_MAX_CONCURRENCY"}


def config_fields() -> tuple[set[str], dict[str, Any]]:
    """(section paths, {leaf path: effective default or REQUIRED}) of MasterConfig, as the reference reads it."""
    found = sections()
    return set(found) - {""}, {leaf.path: leaf.default for leaves in found.values() for leaf in leaves}


def settings_variables() -> dict[str, tuple[Any, str]]:
    """{DOCKYARD_<SERVICE>_<FIELD>: (default, service)} for every service's settings class, and
    {DOCKYARD_<FIELD>: (default, "shared")} for the settings every service shares."""
    variables = {}
    # The policy endpoint serves HTTP, so its settings class is a plain BaseSettings of its own.
    for service in (*DEFAULT_PORTS, "endpoint"):
        module = importlib.import_module(f"services.{service}.settings")
        classes = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and (issubclass(value, ServiceSettings) or value.__module__ == module.__name__)
            and issubclass(value, BaseSettings)
            and value is not ServiceSettings
        ]
        assert len(classes) == 1, f"services/{service}/settings.py should define one settings class, found {classes}"
        cls = classes[0]
        prefix = cls.model_config.get("env_prefix", "")
        assert prefix == f"DOCKYARD_{service.upper()}_", f"{cls.__name__} has env_prefix {prefix!r}"
        for name, field in cls.model_fields.items():
            variables[f"{prefix}{name.upper()}"] = (field.get_default(call_default_factory=True), service)
    for shared in (AuthSettings, DataPlaneSettings):
        shared_prefix = shared.model_config.get("env_prefix", "")
        for name, field in shared.model_fields.items():
            variables[f"{shared_prefix}{name.upper()}"] = (field.get_default(call_default_factory=True), "shared")
    return variables


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def rows(doc: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, default in ROW.findall(doc):
        assert name not in found, f"docs/configuration.md has two rows for `{name}`"
        found[name] = default
    return found


def _expected_cell(value: Any) -> str:
    return "required" if value is REQUIRED else f"`{render(value)}`"


def test_walk_finds_nested_and_optional_sections() -> None:
    sections, leaves = config_fields()
    assert {"policy", "policy.optimizer", "policy.bootstrap", "grpo.reward_shaping", "env.sandbox"} <= sections
    assert leaves["policy.optimizer.lr"] == 1e-5
    assert leaves["policy.bootstrap.recipe"] is REQUIRED
    assert leaves["data.validation.size"] == 64
    assert leaves["data.train.size"] == 256


def test_every_config_section_has_a_heading(doc: str) -> None:
    sections, _ = config_fields()
    headings = set(HEADING.findall(doc))
    missing = sorted(sections - headings)
    assert not missing, f"docs/configuration.md lacks a '### `path`' heading for config sections: {missing}"


def test_every_config_field_has_a_row_with_its_default(rows: dict[str, str]) -> None:
    _, leaves = config_fields()
    missing = sorted(path for path in leaves if path not in rows)
    assert not missing, f"docs/configuration.md lacks a table row for config fields: {missing}"
    wrong = {
        path: (rows[path], _expected_cell(value))
        for path, value in leaves.items()
        if rows[path] != _expected_cell(value)
    }
    assert not wrong, f"documented default differs from the code (documented, code): {wrong}"


def test_every_settings_field_has_a_row_with_its_default(rows: dict[str, str]) -> None:
    variables = settings_variables()
    missing = sorted(name for name in variables if name not in rows)
    assert not missing, f"docs/configuration.md lacks a table row for service settings: {missing}"
    wrong = {
        name: (rows[name], f"`{render(default)}`")
        for name, (default, _) in variables.items()
        if name not in MACHINE_DEPENDENT and rows[name] != f"`{render(default)}`"
    }
    assert not wrong, f"documented default differs from the code (documented, code): {wrong}"


def test_no_row_documents_something_the_code_lacks(doc: str, rows: dict[str, str]) -> None:
    sections, leaves = config_fields()
    variables = settings_variables()
    config_rows = {name for name in rows if "." in name and not name.startswith("DOCKYARD_")}
    stale = sorted(config_rows - set(leaves))
    stale += sorted(name for name in rows if name.startswith("DOCKYARD_") and name not in variables)
    stale += sorted(h for h in HEADING.findall(doc) if h not in sections)
    assert not stale, f"docs/configuration.md documents names the code does not have: {stale}"


def test_settings_tables_are_per_service(doc: str) -> None:
    """Each variable sits under its own service's '### <Service>' heading."""
    current = None
    placement: dict[str, str | None] = {}
    for line in doc.splitlines():
        if heading := re.match(r"^###\s+(\w+)\s*$", line):
            current = heading.group(1).lower()
        elif row := ROW.match(line):
            if row.group(1).startswith("DOCKYARD_"):
                placement[row.group(1)] = current
    misplaced = {
        name: placement.get(name)
        for name, (_, service) in settings_variables().items()
        if placement.get(name) != service
    }
    assert not misplaced, f"variables under the wrong '### <Service>' heading: {misplaced}"
