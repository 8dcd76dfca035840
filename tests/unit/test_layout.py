"""Package layout: the shared library never depends on a service, and generated stubs live in one place.

`dockyard/` is what every service imports, so an import of `services` from it would tie the
library to one deployable (and, through that deployable, to all the others). The protobuf stubs
are generated into `dockyard/api/` only; a `_pb2` module elsewhere would be a second, unchecked
copy of the contract.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "dockyard"
API = LIBRARY / "api"


def _imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _project_files() -> list[Path]:
    """Every file of the repository, outside hidden folders (.git, .venv) and build metadata."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and not d.endswith(".egg-info")]
        found += [Path(folder) / name for name in files]
    return found


def test_library_never_imports_services() -> None:
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for module in _imported_modules(tree):
            if module == "services" or module.startswith("services."):
                offenders.append(f"{path.relative_to(ROOT)}: {module}")
    assert not offenders, "the library imports services:\n" + "\n".join(offenders)


def test_the_check_sees_every_form_of_import() -> None:
    source = "import services\nimport services.buffer as b\nfrom services.sandbox import swe\ndef f():\n    import os\n"
    assert _imported_modules(ast.parse(source)) == ["services", "services.buffer", "services.sandbox", "os"]


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
    for path in sorted((ROOT / "services").rglob("*.py")):
        own = path.relative_to(ROOT / "services").parts[0]
        for module in _imported_modules(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != own:
                offenders.append(f"{path.relative_to(ROOT)}: {module}")
    assert not offenders, "a service imports another:\n" + "\n".join(offenders)
