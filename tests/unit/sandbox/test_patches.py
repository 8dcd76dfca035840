"""Patch checks before anything applies a patch, and the integrity rule (which paths are protected)."""

from __future__ import annotations

import pytest

from services.sandbox.patches import PatchRefused, inspect_patch, is_test_path, protected_paths

GOOD = """diff --git a/pkg/mod.py b/pkg/mod.py
index 1111111..2222222 100644
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,3 +1,3 @@
 def f(x):
-    return x < 1
+    return x <= 1

@@ -10 +10,2 @@
 tail
+more
\\ No newline at end of file
"""

NEW_FILE = """--- /dev/null
+++ b/pkg/new.py
@@ -0,0 +1,2 @@
+a = 1
+b = 2
"""


def test_accepts_a_git_diff_and_a_plain_diff():
    assert inspect_patch(GOOD) == ["pkg/mod.py"]
    assert inspect_patch(NEW_FILE) == ["pkg/new.py"]
    assert inspect_patch(GOOD + NEW_FILE) == ["pkg/mod.py", "pkg/new.py"]


def test_a_removed_line_that_looks_like_a_header_is_hunk_content():
    patch = "--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,1 @@\n--- a/../evil\n keep\n"
    assert inspect_patch(patch) == ["x.py"]


@pytest.mark.parametrize(
    "patch,words",
    [
        ("", "empty"),
        ("  \n", "empty"),
        ("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "'..'"),
        ("--- a/pkg/../../x.py\n+++ b/pkg/../../x.py\n@@ -1 +1 @@\n-a\n+b\n", "'..'"),
        ("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "absolute"),
        ("diff --git a/x b/../y\nrename from x\nrename to ../y\n", "'..'"),
        ("--- a/.git/config\n+++ b/.git/config\n@@ -1 +1 @@\n-a\n+b\n", ".git"),
        ("diff --git a/x.bin b/x.bin\nGIT binary patch\nliteral 1\nIcmZ?d00001\n", "binary"),
        ("diff --git a/x.bin b/x.bin\nBinary files a/x.bin and b/x.bin differ\n", "binary"),
        ("diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc\n", "symlink"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1,3 +1,3 @@\n-a\n+b\n", "shorter"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n-b\n+c\n", "overruns"),
        ("--- a/x.py\n+++ b/x.py\n@@ nonsense @@\n-a\n", "hunk header"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-a\nnot a hunk line\n", "ends a hunk early"),
        ("just some text\nwith no diff\n", "no file headers"),
        ("--- a/x.py\n+++ b/x.py\n", "no hunks"),
        ("--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+" + "b" * (1024 * 1024 + 1) + "\n", "larger"),
    ],
)
def test_refuses(patch, words):
    with pytest.raises(PatchRefused, match=words.replace(".", r"\.").replace("(", r"\(")):
        inspect_patch(patch)


@pytest.mark.parametrize(
    "path,protected",
    [
        ("pkg/mod.py", False),
        ("tests/helpers.py", True),
        ("pkg/tests/data.json", True),
        ("testing/x.py", True),
        ("pkg/test_mod.py", True),
        ("pkg/mod_test.py", True),
        ("conftest.py", True),
        ("pkg/conftest.py", True),
        ("pytest.ini", True),
        ("setup.cfg", True),
        ("pyproject.toml", True),
        ("pkg/testament.py", False),
        ("pkg/contest.py", False),
    ],
)
def test_test_paths(path, protected):
    assert is_test_path(path) is protected


def test_protected_paths_include_the_test_patch_files_wherever_they_are():
    touched = ["pkg/mod.py", "docs/example_check.py", "tests/test_mod.py"]
    assert protected_paths(touched, ["docs/example_check.py"]) == ["docs/example_check.py", "tests/test_mod.py"]
    assert protected_paths(["pkg/mod.py"], ["tests/test_mod.py"]) == []
