"""Package layout: every module imports only what docs/architecture.md's "Where things live" table allows,
the shared library never depends on a service, and generated stubs live in one place.

The table (| folder | owns | may import |) is read from the doc, so the doc is the one statement of the
rule. How a row reads:
- The folder cell names folders (`dockyard/rpc/`) or files (`dockyard/jobs.py`), several separated by
  commas; `<name>` stands for any one folder (`services/<service>/`: each service). A module belongs to
  the row whose folder or file is the most specific one holding it. Rows outside dockyard/ and services/
  (the protos) hold no module of the packages and are not checked here. Every module must belong to a
  row (but `services/__init__.py`, the bare package of the services, which must import nothing of the
  project).
- The may-import cell grants, among project modules (dockyard.*, services.*), only what it names before
  the word "never" (what follows "never" restates a refusal and grants nothing): each backticked
  module name (`dockyard.config`: that module or package and everything under it), and "the library":
  every module of a dockyard/ row that does not itself say "the library" (so the CLI's row, which may
  import the library, is not part of it). Other words ("torch", "protobuf, grpc", "nothing of the
  project", "(protos only)") name no project module, so they grant none: the standard library and
  third-party packages are not checked.
- A module may always import the modules of its own row; for a row with `<name>`, those of the same
  folder only (a service imports itself, never another service).
Imports are read as tests/unit/project_imports.py says: every form, inside functions and under
TYPE_CHECKING included.

`dockyard/` is what every service imports, so an import of `services` from it would tie the library to
one deployable (and, through that deployable, to all the others). The protobuf stubs are generated into
`dockyard/api/` only; a `_pb2` module elsewhere would be a second, unchecked copy of the contract.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.project_imports import (
    PACKAGES,
    ROOT,
    imports_of,
    owning_module,
    project_imports,
    project_modules,
)

LIBRARY = ROOT / "dockyard"
API = LIBRARY / "api"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LIBRARY_WORDS = "the library"


@dataclass(frozen=True)
class Row:
    patterns: tuple[tuple[str, ...], ...]  # module-name parts; "<...>" matches any one part
    files: tuple[bool, ...]  # per pattern: a file (that module only) or a folder (it and all under it)
    grants: tuple[str, ...]  # module prefixes the row may import
    library: bool  # the row may import "the library"
    text: str

    def match(self, module: str) -> tuple[int, str] | None:
        """(specificity, the concrete home) of the most specific pattern holding `module`, else None."""
        parts = module.split(".")
        best = None
        for pattern, is_file in zip(self.patterns, self.files, strict=True):
            fits = len(parts) == len(pattern) if is_file else len(parts) >= len(pattern)
            if fits and all(p.startswith("<") or p == part for p, part in zip(pattern, parts, strict=False)):
                home = ".".join(parts[: len(pattern)]) if any(p.startswith("<") for p in pattern) else self.text
                if best is None or len(pattern) > best[0]:
                    best = (len(pattern), home)
        return best


def _pattern(path: str) -> tuple[str, ...]:
    """`dockyard/rpc/` -> (dockyard, rpc); `dockyard/jobs.py` -> (dockyard, jobs);
    `dockyard/__init__.py` -> (dockyard,)."""
    parts = [part for part in path.split("/") if part]
    if parts[-1].endswith(".py"):
        parts[-1] = parts[-1].removesuffix(".py")
        if parts[-1] == "__init__":
            parts.pop()
    return tuple(parts)


def parse_table(markdown: str) -> list[Row]:
    """The rows of the "| folder | owns | may import |" table under "## Where things live"."""
    section = markdown.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(
        i for i, line in enumerate(lines) if re.match(r"^\|\s*folder\s*\|\s*owns\s*\|\s*may import\s*\|", line)
    )
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        folder, _owns, may = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        paths = [p for p in re.findall(r"`([^`]+)`", folder) if p.split("/")[0] in PACKAGES]
        if not paths:
            continue  # not a folder of the packages (the protos)
        granting = may.split("never", 1)[0]
        grants = tuple(n for n in re.findall(r"`([^`]+)`", granting) if n.split(".")[0] in PACKAGES and "/" not in n)
        patterns = tuple(_pattern(p) for p in paths)
        files = tuple(p.endswith(".py") for p in paths)
        rows.append(Row(patterns, files, grants, LIBRARY_WORDS in granting, folder))
    return rows


def _row_of(rows: list[Row], module: str) -> tuple[Row, str] | None:
    matches = [(m, row) for row in rows if (m := row.match(module))]
    if not matches:
        return None
    (_, home), row = max(matches, key=lambda item: item[0][0])
    return row, home


def _allowed(rows: list[Row], importer: str, target: str) -> bool:
    own_row, own_home = _row_of(rows, importer)
    found = _row_of(rows, target)
    if found and found == (own_row, own_home):
        return True
    if any(target == g or target.startswith(g + ".") for g in own_row.grants):
        return True
    if own_row.library and found:
        target_row = found[0]
        return target_row.patterns[0][0] == "dockyard" and not target_row.library
    return False


def _breaches(rows: list[Row]) -> tuple[list[str], list[str]]:
    """(modules no row holds, 'module: import' lines the table does not allow)."""
    unplaced, breaches = [], []
    for module in project_modules():
        if module == "services":
            targets = [t for t in map(owning_module, project_imports(module)) if t and t != module]
            breaches += [f"services/__init__.py: {t} (it must import nothing of the project)" for t in targets]
            continue
        if _row_of(rows, module) is None:
            unplaced.append(module)
            continue
        for name in project_imports(module):
            target = owning_module(name)
            if target is None or target == module or _allowed(rows, module, target):
                continue
            breaches.append(f"{module}: {target}")
    return unplaced, sorted(set(breaches))


def test_every_module_imports_only_what_its_row_of_the_table_allows() -> None:
    rows = parse_table(ARCHITECTURE.read_text(encoding="utf-8"))
    unplaced, breaches = _breaches(rows)
    assert not unplaced, "modules in no row of docs/architecture.md's 'Where things live' table:\n" + "\n".join(
        unplaced
    )
    assert not breaches, "imports the 'Where things live' table does not allow:\n" + "\n".join(breaches)


SAMPLE_TABLE = """
## Where things live

| folder | owns | may import |
| --- | --- | --- |
| `protos/x/` | the wire contract | (protos only) |
| `dockyard/api/` | stubs | protobuf, grpc |
| `dockyard/low/` | low things | `dockyard.api` |
| `dockyard/mid/`, `dockyard/top.py` | middle things | `dockyard.low`; never `dockyard.cli` |
| `dockyard/cli.py` | the CLI | the library; never `services/` |
| `services/<service>/` | services | the library; never another service |

## Next
"""


@pytest.mark.parametrize(
    ("importer", "target", "allowed"),
    [
        ("dockyard.low.a", "dockyard.api.common.v1.common_pb2", True),  # a named module's submodule
        ("dockyard.low.a", "dockyard.low.b", True),  # its own row
        ("dockyard.low.a", "dockyard.mid.c", False),  # up the layers
        ("dockyard.mid.c", "dockyard.top", True),  # the same row, another of its entries
        ("dockyard.mid.c", "dockyard.low", True),
        ("dockyard.mid.c", "dockyard.cli", False),  # named after "never": refused, not granted
        ("dockyard.api.x", "dockyard.low.a", False),  # "protobuf, grpc" grant no project module
        ("dockyard.cli", "dockyard.mid.c", True),  # the library
        ("services.a.x", "dockyard.mid.c", True),
        ("services.a.x", "dockyard.cli", False),  # the CLI's row imports the library: not part of it
        ("services.a.x", "services.a.y", True),  # the same service
        ("services.a.x", "services.b.y", False),  # another service
        ("dockyard.cli", "services.a.x", False),
        ("dockyard.top", "dockyard.low.a", True),  # a file of a row
        ("dockyard.top.x", "dockyard.cli", None),  # under a file's name: in no row
    ],
)
def test_the_table_reads_as_the_docstring_says(importer: str, target: str, allowed: bool | None) -> None:
    rows = parse_table(SAMPLE_TABLE)
    assert len(rows) == 5  # the protos' row holds no module of the packages
    if allowed is None:
        assert _row_of(rows, importer) is None
    else:
        assert _allowed(rows, importer, target) is allowed


def test_the_table_names_only_modules_that_exist() -> None:
    # A grant with a typo would silently allow nothing (or the wrong thing).
    rows = parse_table(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = [g for row in rows for g in row.grants if owning_module(g) != g]
    assert not missing, f"may-import names no module of the tree: {missing}"


KNOWN = {"services", "services.trainer", "services.sandbox", "services.sandbox.swe", "dockyard", "dockyard.rpc"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import services\nimport services.buffer as b\n", ["services", "services.buffer"]),
        ("from services import trainer\n", ["services.trainer"]),  # a module: the real target
        ("from services import settings_value\n", ["services"]),  # a name, not a module
        ("from services.sandbox import swe, Outcome\n", ["services.sandbox.swe", "services.sandbox"]),
        ("from services.sandbox import *\n", ["services.sandbox"]),
        ("from . import swe\n", ["services.sandbox.swe"]),  # relative, against the module's package
        ("from .swe import score\n", ["services.sandbox.swe"]),
        ("from . import helper\n", ["services.sandbox"]),
        ("from .. import trainer\n", ["services.trainer"]),
        ("from ..trainer.policy import P\n", ["services.trainer.policy"]),
        ("def f():\n    import dockyard.rpc\n", ["dockyard.rpc"]),  # inside a function
        ("class C:\n    def m(self):\n        from dockyard import rpc\n", ["dockyard.rpc"]),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dockyard.rpc\n", ["typing", "dockyard.rpc"]),
        ("import importlib\nm = importlib.import_module('services.trainer')\n", ["importlib", "services.trainer"]),
        (
            "from importlib import import_module\nimport_module('.swe', 'services.sandbox')\n",
            ["importlib", "services.sandbox.swe"],
        ),
        ("import importlib\nimportlib.import_module(name)\nimportlib.import_module(f'a.{x}')\n", ["importlib"]),
        ("x = 'import services'\n# import services\n", []),  # text that only looks like an import
    ],
)
def test_the_extractor_resolves_every_form_of_import(source: str, expected: list[str]) -> None:
    assert imports_of(source, "services.sandbox.local", known=KNOWN) == expected


def test_relative_imports_in_a_package_start_from_the_package_itself() -> None:
    assert imports_of("from . import swe\n", "services.sandbox", is_package=True, known=KNOWN) == [
        "services.sandbox.swe"
    ]
    with pytest.raises(ValueError, match="above the top-level package"):
        imports_of("from ... import x\n", "services.sandbox.local", known=KNOWN)


def _project_files() -> list[Path]:
    """Every file of the repository, outside hidden folders (.git, .venv) and build metadata."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and not d.endswith(".egg-info")]
        found += [Path(folder) / name for name in files]
    return found


def test_library_never_imports_services() -> None:
    offenders = [
        f"{module}: {name}"
        for module in project_modules()
        if module.split(".")[0] == "dockyard"
        for name in project_imports(module)
        if name.split(".")[0] == "services"
    ]
    assert not offenders, "the library imports services:\n" + "\n".join(offenders)


def test_generated_stubs_live_only_under_dockyard_api() -> None:
    stray = [
        str(path.relative_to(ROOT))
        for path in _project_files()
        if path.suffix in (".py", ".pyi") and "_pb2" in path.stem and API not in path.parents
    ]
    assert not stray, f"_pb2 modules outside dockyard/api/: {stray}"


def test_a_service_never_imports_another_service() -> None:
    # Each service is its own deployable: what two of them share belongs in the library.
    offenders = []
    for module in project_modules():
        parts = module.split(".")
        if parts[0] != "services" or len(parts) < 2:
            continue
        for name in project_imports(module):
            target = name.split(".")
            if target[0] == "services" and len(target) > 1 and target[1] != parts[1]:
                offenders.append(f"{module}: {name}")
    assert not offenders, "a service imports another:\n" + "\n".join(offenders)
