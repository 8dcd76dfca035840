"""The field reference of docs/configuration.md, from each field's one source: its Field(description=...).

    python -m dockyard.config.reference                         print every section's table
    python -m dockyard.config.reference docs/configuration.md   list how the doc differs; exit 1 if it does

Guarantees: every leaf key of MasterConfig (a field whose type is not a section) is listed with
its effective default and its description; `doc_problems` reports a leaf without a description,
a leaf without a doc row, a row whose default or text differs from the code, and a row naming a
key the code lacks. A unit test asserts it finds nothing in docs/configuration.md, so a field's
meaning is written once, in the code, and the doc's row is a copy of it.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from dockyard.config.master import MasterConfig

REQUIRED = object()
# | `dotted.path` | default | meaning |
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*?)\s*\|\s*(.*?)\s*\|\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Leaf:
    path: str
    default: Any  # REQUIRED when the field has none
    description: str | None

    @property
    def default_cell(self) -> str:
        return "required" if self.default is REQUIRED else f"`{render(self.default)}`"

    @property
    def row(self) -> str:
        return f"| `{self.path}` | {self.default_cell} | {self.description or ''} |"


def render(value: Any) -> str:
    """A default as the doc writes it: null, true/false, bare strings ("" when empty), JSON otherwise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field (`X`, `X | None`, `list[X]`), or None for a leaf."""
    for candidate in getattr(annotation, "__args__", (annotation,)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def sections(
    model: type[BaseModel] = MasterConfig, instance: BaseModel | None = None, prefix: str = ""
) -> dict[str, list[Leaf]]:
    """{section path: its leaves}, in declaration order; defaults are the effective ones
    (`data.validation.size` is 64 because the `data.validation` section's own default says so)."""
    found: dict[str, list[Leaf]] = {prefix.rstrip("."): []}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if instance is not None:
            value = getattr(instance, name)
        elif field.is_required():
            value = REQUIRED
        else:
            value = field.get_default(call_default_factory=True)
        section = section_type(field.annotation)
        if section is None:
            found[prefix.rstrip(".")].append(Leaf(path, value, field.description))
        else:
            found |= sections(section, value if isinstance(value, BaseModel) else None, f"{path}.")
    return found


def leaves(model: type[BaseModel] = MasterConfig) -> dict[str, Leaf]:
    return {leaf.path: leaf for group in sections(model).values() for leaf in group}


def tables(model: type[BaseModel] = MasterConfig) -> str:
    """Every section's table of fields, as docs/configuration.md lays them out."""
    parts = []
    for path, group in sections(model).items():
        if group:
            rows = "\n".join(leaf.row for leaf in group)
            parts.append(f"### `{path}`\n\n| field | default | meaning |\n| --- | --- | --- |\n{rows}\n")
    return "\n".join(parts)


def doc_problems(doc: str, model: type[BaseModel] = MasterConfig) -> list[str]:
    """How the field rows of `doc` differ from `model`'s fields; empty when the doc is a true copy."""
    rows = {path: (default, meaning) for path, default, meaning in ROW.findall(doc)}
    problems = []
    known = leaves(model)
    for path, leaf in known.items():
        if not leaf.description:
            problems.append(f"{path}: the field has no description")
        if path not in rows:
            problems.append(f"{path}: no row in the doc; add: {leaf.row}")
            continue
        default, meaning = rows[path]
        if default != leaf.default_cell:
            problems.append(f"{path}: the doc's default is {default}, the code's {leaf.default_cell}")
        if leaf.description and meaning != leaf.description:
            problems.append(f"{path}: the doc says {meaning!r}, the field's description {leaf.description!r}")
    # A dotted name is a config key (service settings are DOCKYARD_* variables, CLI rows flags).
    problems += [
        f"{path}: a doc row for a key the code lacks"
        for path in rows
        if "." in path and not path.startswith("DOCKYARD_") and path not in known
    ]
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(tables())
        return 0
    problems = doc_problems(Path(argv[0]).read_text(encoding="utf-8"))
    print("\n".join(problems) or f"{argv[0]}: every field's row matches its description")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
