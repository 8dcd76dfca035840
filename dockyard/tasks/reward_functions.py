"""Where a reward named in `env.reward` comes from: a built-in name or a user function's source.

    "pass_fraction" | "all_pass"                        built in: computed from the verdict
    "pkg.module:function"  ──locate (PathFinder, no import)──┐
    "path/to/file.py:function" ──(relative to the cwd)───────┴─> source text ──defines (ast)──> RewardSource
                                                                  shipped to the sandbox's Reward RPC

Guarantees: nothing here imports or runs the user's code (a dotted module is found by walking
importlib's PathFinder through the parent packages' folders, not by importing them; the function is
found by parsing the file with `ast`), so the coordinator and `dockyard preflight` can check a
reward function without executing it; every failure is a RewardFunctionError naming the spec, the
file and the fix. Only the named file travels to the sandbox: what it imports must be there already
(the standard library, or packages installed in the sandbox's interpreter or image). How a reward is
written (`syntax_error`, BUILTIN_REWARDS) is dockyard.config.reward_spec's, which the config checks at load.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from dockyard.config.reward_spec import BUILTIN_REWARDS, syntax_error

MAX_SOURCE_BYTES = 1 << 20


class RewardFunctionError(ValueError):
    """A reward function that cannot be found or does not define the named function."""


@dataclass(frozen=True)
class RewardSource:
    origin: str  # the spec as written: names the function in errors and logs
    function: str
    source: str
    path: str


def is_function(spec: str) -> bool:
    return spec not in BUILTIN_REWARDS


def locate(spec: str, cwd: str | None = None) -> tuple[Path, str]:
    """(the file that defines the function, the function's name), found without importing anything."""
    problem = syntax_error(spec)
    if problem is not None:
        raise RewardFunctionError(problem)
    if not is_function(spec):
        raise RewardFunctionError(f"{spec!r} is a built-in reward, not a function")
    target, function = spec.rsplit(":", 1)
    base = Path(cwd or os.getcwd())
    if target.endswith(".py"):
        path = Path(target) if Path(target).is_absolute() else base / target
        if not path.is_file():
            raise RewardFunctionError(f"reward function {spec}: no file {path} (a relative path is from {base})")
        return path, function
    return _module_file(spec, target, str(base)), function


def _module_file(spec: str, module: str, cwd: str) -> Path:
    parts = module.split(".")
    search: list[str] | None = [cwd, *sys.path]
    found = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        found = PathFinder.find_spec(name, search)
        if found is None:
            raise RewardFunctionError(
                f"reward function {spec}: no module {name!r} in the working directory {cwd} or on the import path; "
                "install the package, add its folder to PYTHONPATH, or name the file (path/to/file.py:function)"
            )
        search = list(found.submodule_search_locations or []) or None
        if i < len(parts) - 1 and search is None:
            raise RewardFunctionError(f"reward function {spec}: {name!r} is a module, not a package")
    assert found is not None
    origin = found.origin  # a package's is its __init__.py
    if not origin or not origin.endswith(".py") or not Path(origin).is_file():
        raise RewardFunctionError(f"reward function {spec}: module {module!r} has no Python source file ({origin})")
    return Path(origin)


def defines(source: str, function: str, where: str) -> None:
    """RewardFunctionError unless `source` parses and defines `function` at its top level (a plain def)."""
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as exc:
        raise RewardFunctionError(f"{where}, line {exc.lineno}: not valid Python: {exc.msg}") from None
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    node = functions.get(function)
    if node is None:
        raise RewardFunctionError(
            f"{where} defines no top-level function {function!r} (it defines: {', '.join(sorted(functions)) or 'none'})"
        )
    if isinstance(node, ast.AsyncFunctionDef):
        raise RewardFunctionError(
            f"{where}, line {node.lineno}: {function!r} is async; a reward function is a plain def"
        )
    positional = node.args.posonlyargs + node.args.args
    if len(positional) < 3 and node.args.vararg is None:
        raise RewardFunctionError(
            f"{where}, line {node.lineno}: {function}() must take three arguments (task, completion, verdict)"
        )


def load(spec: str, cwd: str | None = None) -> RewardSource:
    """The function's source, checked to define it; RewardFunctionError saying what is wrong."""
    path, function = locate(spec, cwd)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RewardFunctionError(f"reward function {spec}: cannot read {path}: {exc}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise RewardFunctionError(f"reward function {spec}: {path} is over {MAX_SOURCE_BYTES} bytes")
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RewardFunctionError(f"reward function {spec}: {path} is not UTF-8 ({exc})") from None
    defines(source, function, str(path))
    return RewardSource(origin=spec, function=function, source=source, path=str(path))
