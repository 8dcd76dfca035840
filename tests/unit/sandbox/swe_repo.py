"""A tiny SWE task set made on the spot: one repository, one injected bug, rows shaped as SWE-bench's.

upstream (branch): pkg/core.py correct + tests/test_core.py
base_commit (branch instances/<id>): the bug in; the tests held out (or kept, with an empty test_patch)
<root>/<task set>/repos/o__r.git: a mirror that also holds upstream, as the task builder's do
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

FIXED = "def add(a, b):\n    return a + b\n"
BUGGY = "def add(a, b):\n    return a - b\n"
TEST_FILE = "tests/test_core.py"
F2P = [f"{TEST_FILE}::test_add"]
P2P = [f"{TEST_FILE}::test_zero"]
_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@localhost",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_ENV, "HOME": str(repo)}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True).stdout


def many(log_bytes: int) -> list[str]:
    """Ids of the parametrized test that makes `pytest -rA`'s summary about `log_bytes` long."""
    return [f"{TEST_FILE}::test_many[{i}]" for i in range(max(1, log_bytes // 45))]


def tests_source(log_bytes: int) -> str:
    return (
        "import pytest\n\nfrom pkg import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_zero():\n    assert add(0, 0) == 0\n\n\n"
        f"@pytest.mark.parametrize('i', range({len(many(log_bytes))}))\ndef test_many(i):\n    pass\n"
    )


def make_task_set(
    root: Path, name: str = "set", *, log_bytes: int = 0, hold_out_tests: bool = True, repo: str = "o/r"
) -> dict:
    """Write <root>/<name>/instances.jsonl (one SWE-bench-shaped row) and its mirror; return the row."""
    work = root / f"{name}-src"
    (work / "pkg").mkdir(parents=True)
    (work / "tests").mkdir()
    (work / "pkg" / "__init__.py").write_text("from pkg.core import add\n")
    (work / "pkg" / "core.py").write_text(FIXED)
    (work / TEST_FILE).write_text(tests_source(log_bytes))
    git(work, "init", "--quiet", "--initial-branch=upstream")
    git(work, "add", "--all")
    git(work, "commit", "--quiet", "-m", "upstream")
    git(work, "checkout", "--quiet", "-b", "instances/i")
    (work / "pkg" / "core.py").write_text(BUGGY)
    if hold_out_tests:
        git(work, "rm", "--quiet", "--", TEST_FILE)
    git(work, "commit", "--quiet", "--all", "-m", "base")
    base = git(work, "rev-parse", "HEAD").strip()
    gold = git(work, "diff", base, "upstream", "--", "pkg")
    test_patch = git(work, "diff", base, "upstream", "--", "tests")
    git(work, "checkout", "--quiet", "upstream")
    mirror = root / name / "repos" / "o__r.git"
    subprocess.run(["git", "clone", "--quiet", "--mirror", str(work), str(mirror)], check=True)
    row = {  # the columns of princeton-nlp/SWE-bench, as its JSON lines hold them
        "repo": repo,
        "instance_id": "o__r-1",
        "base_commit": base,
        "patch": gold,
        "test_patch": test_patch,
        "problem_statement": "add() subtracts",
        "hints_text": "",
        "created_at": "2020-01-01T00:00:00Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(F2P),
        "PASS_TO_PASS": json.dumps([*P2P, many(log_bytes)[-1]]),  # the last summary line is graded too
        "environment_setup_commit": base,
    }
    (root / name / "instances.jsonl").write_text(json.dumps(row) + "\n")
    return row


def cheat_patch() -> str:
    """Leaves the bug alone; at import, copies pkg/core.py from any other ref or object git can find."""
    code = """import subprocess


def _git(*args):
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout


for _ref in ["origin/upstream", "upstream", *_git("rev-list", "--all").split()]:
    subprocess.run(["git", "checkout", _ref, "--", "pkg/core.py"], capture_output=True)
    if "a + b" in open("pkg/core.py").read():
        break
else:
    for _line in _git("cat-file", "--batch-all-objects", "--batch-check").splitlines():
        _sha, _kind = _line.split()[:2]
        if _kind == "blob" and _git("cat-file", "blob", _sha) == "def add(a, b):\\n    return a + b\\n":
            open("pkg/core.py", "w").write(_git("cat-file", "blob", _sha))
from pkg.core import add  # noqa: E402
"""
    lines = code.splitlines(keepends=True)
    hunk = "".join("+" + line for line in lines)
    return f"--- a/pkg/__init__.py\n+++ b/pkg/__init__.py\n@@ -1 +1,{len(lines)} @@\n-from pkg.core import add\n{hunk}"
