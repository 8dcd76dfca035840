#!/bin/bash
python3 - <<'PY'
from pathlib import Path

path = Path("/app/calc.py")
source = path.read_text()
fixed = source.replace(
    "    return sum(values) / (len(values) + 1)",
    "    return sum(values) / len(values) if values else 0.0",
)
path.write_text(fixed)
PY
