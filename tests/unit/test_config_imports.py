"""The config package sits under every other layer: importing it loads nothing else of dockyard."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "dockyard" / "config"
ALLOWED = {"pydantic", "yaml", "omegaconf", "annotated_types", *sys.stdlib_module_names}


def test_config_imports_only_itself_pydantic_yaml_omegaconf_and_the_standard_library() -> None:
    offenders = []
    for path in sorted(CONFIG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if not (name.startswith("dockyard.config") or name.split(".")[0] in ALLOWED):
                    offenders.append(f"{path.name}: {name}")
    assert not offenders, "dockyard/config imports above itself:\n" + "\n".join(offenders)


def test_importing_the_config_loads_no_other_dockyard_module() -> None:
    code = "import sys, dockyard.config; print(sorted(m for m in sys.modules if m.startswith('dockyard')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out.strip())
    assert [m for m in loaded if m != "dockyard" and not m.startswith("dockyard.config")] == []
