"""What each module of dockyard/ and services/ imports, as absolute module names (read with `ast`, never run).

    source of module M ──imports_of──> ["pkg.mod", ...]   every import form, resolved
    dockyard/, services/ ──import_graph──> {module: {project module it imports}}

The rules of resolution (test_layout.py feeds each form to `imports_of`):
- `import a.b.c` yields `a.b.c`; `from a.b import c` yields `a.b.c` when that is a module or package
  of the tree, else `a.b` (c is a name defined in a.b); `from a.b import *` yields `a.b`.
- Relative imports resolve against the importing module's package: `from . import x` in
  `services/sandbox/local.py` is `services.sandbox.x` (or `services.sandbox`), `from ..pkg import z`
  goes one package further up.
- Imports anywhere count: at module level, inside functions and classes, and under
  `if TYPE_CHECKING:`. A type-only import is still a dependency of what the module means, and a
  circle or an upward import moved behind TYPE_CHECKING or into a function is hidden, not removed.
- `importlib.import_module("a.b")` (or a bare `import_module(...)`) with a string literal counts as
  an import of `a.b` (relative with a literal `package=`: resolved against it); a computed name
  cannot be known without running the code and is not seen.
- Importing `a.b.c` also runs the packages `a` and `a.b`; those implicit parent imports are not
  counted, or every package whose `__init__` imports its own modules would be a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dockyard", "services")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_modules() -> dict[str, Path]:
    """Every module and package of dockyard/ and services/, by absolute name."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _package_of(module: str, is_package: bool, level: int) -> str:
    """The package a relative import of `level` dots starts from."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        raise ValueError(f"{module}: a relative import of {level} dots goes above the top-level package")
    return ".".join(parts[: len(parts) - (level - 1)])


def _literal_import(node: ast.Call) -> tuple[str, str | None] | None:
    """(name, package) of importlib.import_module("literal"[, package="literal"]), else None."""
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )
    if not named or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    package = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"), None)
    literal_package = package.value if isinstance(package, ast.Constant) and isinstance(package.value, str) else None
    return first.value, literal_package


def imports_of(source: str, module: str, *, is_package: bool = False, known: Collection[str] = ()) -> list[str]:
    """Every module the source of `module` imports, resolved to absolute names, in source order
    (duplicates kept). `known`: the modules and packages that exist, to tell `from pkg import module`
    from `from pkg import name`."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        where = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if isinstance(node, ast.Import):
            found += [(*where, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, is_package, node.level)
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((*where, candidate if alias.name != "*" and candidate in known else base))
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            name, package = literal
            if name.startswith("."):
                if package is None:
                    continue  # relative to a package only known at run time
                level = len(name) - len(name.lstrip("."))
                rest = name[level:]
                start = _package_of(package, True, level)
                name = f"{start}.{rest}" if rest else start
            found.append((*where, name))
    return [name for *_, name in sorted(found, key=lambda item: (item[0], item[1]))]


@cache
def project_imports(module: str) -> tuple[str, ...]:
    """The imports of one module of the tree (see imports_of)."""
    path = project_modules()[module]
    source = path.read_text(encoding="utf-8")
    return tuple(imports_of(source, module, is_package=path.name == "__init__.py", known=project_modules()))


def owning_module(name: str) -> str | None:
    """The module of the tree an imported name refers to: itself, or its longest existing prefix;
    None outside dockyard/ and services/."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in project_modules():
            return ".".join(parts[:end])
    return None


def import_graph() -> dict[str, set[str]]:
    """Each module of the tree -> the other modules of the tree it imports."""
    graph: dict[str, set[str]] = {}
    for module in project_modules():
        targets = {owning_module(name) for name in project_imports(module)}
        graph[module] = {target for target in targets if target is not None and target != module}
    return graph
