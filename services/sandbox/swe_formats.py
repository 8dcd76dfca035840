"""Row formats of SWE datasets that ship a prebuilt image per row -> the image, its layout, its test command.

    <task set>/dataset.json {"format": NAME}  (optional; wins over detection)
    or the columns of the first row ──detect──> swe-bench | swe-gym | swe-rebench | swe-smith | r2e-gym | None
    (format, row) ──as_swe_row──> SWE-bench's columns (swe-smith, r2e-gym; the others already are)
    (format, row) ──prebuilt_env──> PrebuiltEnv(image, repo_dir, env_bin, start, ...)  or  FormatRefused
    (format, row, spec table) ──prebuilt_test_cmd──> argv

Formats (the columns read, the image rule, where the start tree comes from):
- swe-bench: SWE-bench's columns; the image is its harness's eval image of the instance,
  `swebench/sweb.eval.x86_64.<instance_id, "__" -> "_1776_", lower case>:latest`. Named in
  dataset.json only: the same columns without it keep the spec-built environment (swe_specs.py).
- swe-gym: SWE-bench's columns; the image is `xingyaoww/sweb.eval.x86_64.<instance_id, "__" ->
  "_s_", lower case>:latest`, as SWE-Gym's published images are named. Named in dataset.json only.
- swe-rebench: detected by `docker_image` + `install_config`; the image is `docker_image`, the test
  command `install_config.test_cmd` (else `test_cmd`), the parser `install_config.log_parser` if set.
  These three start from base_commit, checked out of the task set's mirror (checkouts.py).
- swe-smith: detected by `image_name`; the image is `image_name`. SWE-smith's harness checks out
  the instance's branch of its mirror, whose "Bug Patch" commit is the image's repository (at
  /testbed) with the row's `patch` applied and whose head removes the FAIL_TO_PASS test files;
  dockyard builds the same start tree from the image, offline: /testbed + `patch`, those test files
  held out (restored by the test patch when scoring). The gold solution is the reverse of `patch`
  (SWE-smith's gold run applies it with `--reverse`). The test command is the row's `test_cmd`,
  else SWE-smith's Python profile's (`pytest --disable-warnings --color=no --tb=no --verbose`) with
  `-rA` added (so swebench's pytest parser reads it) on the files of FAIL_TO_PASS and PASS_TO_PASS;
  a repository whose SWE-smith profile runs another command needs a `test_cmd` column.
  base_commit is the commit `repo` names (`swesmith/<owner>__<repo>.<commit[:8]>`).
- r2e-gym: detected by `docker_image` without `install_config`; the image is `docker_image` and
  the instance id `instance_id`, else `docker_image`. Its image holds the repository at /testbed
  (its environment in /testbed/.venv), the test script /testbed/run_tests.sh and the tests in
  /r2e_tests; R2E-Gym's runtime hides run_tests.sh and r2e_tests from the agent and runs
  `bash run_tests.sh` in /testbed with the tests linked there as r2e_tests. dockyard does the same:
  the start tree is /testbed without both, which come back as the test patch (r2e_tests/...) when
  scoring, and /r2e_tests is removed from the run image. The verdict compares each test's status
  with `expected_output_json` (grade_expected): R2E-Gym's key rule (a pytest id minus its file,
  joined by ".", ANSI colours and " - <message>" dropped); resolved (reward 1) only when the parsed
  tests are exactly the expected ones and every status matches. Its pass fraction
  (tests_passed / tests_total) is the number of expected tests whose status matches over the
  number expected. `repo` is `r2e-gym/<repo_name>`, base_commit `commit_hash`; the gold patch is
  the row's `patch` column where it has one (else empty: R2E-Gym's `parsed_commit_content` is not
  turned into a patch).

The images of these harnesses lay the repository out at /testbed; those of SWE-bench's harness
and its forks (SWE-smith's too) with a conda environment `testbed` (/opt/miniconda3/envs/testbed).
An image's own `image_name`, `docker_image` or `test_cmd` column is read as it is. The test command
of a swe-bench or swe-gym row is the row's `test_cmd`, else its (repo, version) spec's in swebench's
table; neither: FormatRefused.

Guarantees: detection is by columns only and is the same for every row of a task set (the first
row decides; a row of another format is refused by name at load); every refusal names the
instance, the format and what is missing.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("swe-bench", "swe-gym", "swe-rebench", "swe-smith", "r2e-gym")
FORMAT_FILE = "dataset.json"
REPO_DIR = "/testbed"  # where the images of SWE-bench's harness (and its forks) hold the repository
ENV_BIN = "/opt/miniconda3/envs/testbed/bin"  # their conda environment, first on PATH for the tests
R2E_ENV_BIN = "/testbed/.venv/bin"  # R2E-Gym's images: a uv venv inside the repository
# SWE-smith's Python profile's command (its conda activation is ENV_BIN first on PATH), -rA for the parser.
SWE_SMITH_TEST_CMD = ["pytest", "--disable-warnings", "--color=no", "--tb=no", "--verbose", "-rA"]
R2E_TEST_CMD = ["bash", "run_tests.sh"]  # R2E-Gym's runtime: the image's script, run in the repository


class FormatRefused(ValueError):
    """A row whose format dockyard cannot score; the message names the instance, the format and why."""


@dataclass(frozen=True)
class PrebuiltEnv:
    image: str  # as the dataset names it (a registry prefix is the deployment's, swe_prebuilt.py)
    repo_dir: str  # where the image's environment expects the repository
    env_bin: str  # prepended to PATH for the test command
    start: str = "mirror"  # the start tree: "mirror" (base_commit) or "image" (repo_dir of the image)
    start_patch: str = ""  # applied to the image's repository to make the start tree (SWE-smith's bug)
    held_out: tuple[str, ...] = ()  # repo_dir paths kept from the start tree, given back as the test patch
    held_out_from: tuple[tuple[str, str], ...] = ()  # (image folder, its path in the tree) given back too
    hidden: tuple[str, ...] = ()  # image paths removed from the run image (the held-out tests' originals)
    untracked: tuple[str, ...] = ()  # repo_dir paths kept in the start tree, out of its commit (an environment)


def named_format(folder: Path) -> str | None:
    """The format a task-set folder names in dataset.json, or None; ValueError for a bad file."""
    path = folder / FORMAT_FILE
    if not path.is_file():
        return None
    try:
        name = json.loads(path.read_text()).get("format")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f'{path}: not a JSON object with a "format" key ({exc})') from None
    if name not in FORMATS:
        raise ValueError(f"{path}: format {name!r} is not one of {list(FORMATS)}")
    return name


def detect(columns: set[str]) -> str | None:
    """The format a row's columns identify; None for SWE-bench's own columns (spec-built or dockyard's)."""
    if "image_name" in columns:
        return "swe-smith"
    if "docker_image" in columns:
        return "swe-rebench" if "install_config" in columns else "r2e-gym"
    return None


def _install_config(row: dict) -> dict:
    config = row.get("install_config") or {}
    if isinstance(config, str):  # parquet exports keep it as JSON text
        config = json.loads(config)
    if not isinstance(config, dict):
        raise ValueError(f"install_config must be an object, not {type(config).__name__}")
    return config


def _ids(row: dict) -> str:
    return str(row.get("instance_id") or row.get("docker_image") or row.get("image_name") or "?")


def _json(value: object, name: str, iid: str, fmt: str):
    if isinstance(value, str):  # parquet and JSON-lines exports keep these as JSON text
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise FormatRefused(f"instance {iid!r}: format {fmt}: {name} is not JSON ({exc})") from None
    return value


def as_swe_row(fmt: str | None, row: dict) -> dict:
    """A SWE-smith or R2E-Gym row in SWE-bench's columns (see the module docstring); others as they are."""
    iid = _ids(row)
    if fmt == "swe-smith":
        missing = [c for c in ("instance_id", "repo", "patch", "image_name", "FAIL_TO_PASS") if not row.get(c)]
        if missing:
            raise FormatRefused(f"instance {iid!r}: format swe-smith: {', '.join(missing)} missing or empty")
        commit = str(row["repo"]).rsplit(".", 1)[-1]
        return {
            **row,
            "base_commit": row.get("base_commit") or commit,
            "patch": reverse_patch(str(row["patch"])),  # the gold solution undoes the bug
            "bug_patch": str(row["patch"]),
            "test_patch": "",  # the held-out tests come from the image (swe_image_trees.py)
        }
    if fmt == "r2e-gym":
        expected = _json(row.get("expected_output_json"), "expected_output_json", iid, fmt)
        if not isinstance(expected, dict) or not expected:
            raise FormatRefused(
                f"instance {iid!r}: format r2e-gym: expected_output_json is missing or empty; "
                "it is what a verdict compares the tests' statuses with"
            )
        missing = [c for c in ("docker_image", "repo_name", "commit_hash") if not row.get(c)]
        if missing:
            raise FormatRefused(f"instance {iid!r}: format r2e-gym: {', '.join(missing)} missing or empty")
        expected = {r2e_key(str(k)): str(v) for k, v in expected.items()}
        return {
            **row,
            "instance_id": iid,
            "repo": f"r2e-gym/{row['repo_name']}",
            "base_commit": str(row["commit_hash"]),
            "patch": str(row.get("patch") or ""),
            "test_patch": "",
            "FAIL_TO_PASS": sorted(expected),
            "PASS_TO_PASS": [],
            "expected_statuses": expected,
            "log_parser": "parse_log_pytest",
        }
    return row


def prebuilt_env(fmt: str, row: dict) -> PrebuiltEnv:
    """The image and layout of a row of `fmt` (as_swe_row's for swe-smith and r2e-gym); FormatRefused
    when it has none."""
    iid = _ids(row)
    if fmt == "swe-smith":
        held = sorted({t.split("::", 1)[0] for t in _json(row["FAIL_TO_PASS"], "FAIL_TO_PASS", iid, fmt)})
        if bad := [h for h in held if h.startswith("/") or ".." in h.split("/") or not h.strip()]:
            raise FormatRefused(
                f"instance {iid!r}: format swe-smith: FAIL_TO_PASS names test files outside the repository: {bad}"
            )
        return PrebuiltEnv(
            str(row["image_name"]), REPO_DIR, ENV_BIN, "image", start_patch=str(row["bug_patch"]),
            held_out=tuple(held),
        )  # fmt: skip
    if fmt == "r2e-gym":
        return PrebuiltEnv(
            str(row["docker_image"]), REPO_DIR, R2E_ENV_BIN, "image", held_out=("run_tests.sh", "r2e_tests"),
            held_out_from=(("/r2e_tests", "r2e_tests"),), hidden=("/r2e_tests",), untracked=(".venv",),
        )  # fmt: skip
    if fmt == "swe-rebench":
        image = str(row.get("docker_image") or "")
        if not image:
            raise FormatRefused(f"instance {iid!r}: format swe-rebench: docker_image is empty")
    elif fmt in ("swe-bench", "swe-gym"):
        key = iid.replace("__", "_1776_" if fmt == "swe-bench" else "_s_").lower()
        namespace = "swebench" if fmt == "swe-bench" else "xingyaoww"
        image = f"{namespace}/sweb.eval.x86_64.{key}:latest"
    else:
        raise FormatRefused(f"instance {iid!r}: unknown format {fmt!r}; known: {list(FORMATS)}")
    return PrebuiltEnv(image=image, repo_dir=REPO_DIR, env_bin=ENV_BIN)


def prebuilt_test_cmd(fmt: str, row: dict, spec_test_cmd: str | None) -> list[str]:
    """The test command (without the test files) of a prebuilt-image row; FormatRefused when none is known."""
    iid = str(row.get("instance_id", "?"))
    cmd = row.get("test_cmd")
    if fmt == "swe-rebench":
        cmd = _install_config(row).get("test_cmd") or cmd
    if cmd is None and fmt in ("swe-bench", "swe-gym"):
        cmd = spec_test_cmd
    if cmd is None and fmt == "swe-smith":  # every test the grade reads is in these files
        tests = [*_json(row["FAIL_TO_PASS"], "", iid, fmt), *_json(row.get("PASS_TO_PASS") or [], "", iid, fmt)]
        cmd = [*SWE_SMITH_TEST_CMD, *sorted({t.split("::", 1)[0] for t in tests})]
    if fmt == "r2e-gym":
        cmd = cmd or R2E_TEST_CMD
    if isinstance(cmd, list) and len(cmd) == 1:  # SWE-rebench writes a list of one shell command
        cmd = cmd[0]
    if isinstance(cmd, list) and all(isinstance(w, str) for w in cmd) and cmd:
        return list(cmd)
    if isinstance(cmd, str) and cmd.strip():
        return shlex.split(cmd)
    raise FormatRefused(
        f"instance {iid!r} ({row.get('repo')} version {row.get('version')!r}): format {fmt}: no test command "
        "(neither a test_cmd column nor a spec of swebench's table for this repo and version)"
    )


def log_parser_of(fmt: str, row: dict) -> str | None:
    """The row's log parser name, where its format carries one (None: by repository)."""
    if fmt == "swe-rebench" and _install_config(row).get("log_parser"):
        return str(_install_config(row)["log_parser"])
    return row.get("log_parser")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def r2e_key(test: str) -> str:
    """R2E-Gym's name of a test: colours dropped, " - <message>" dropped, a pytest id minus its file."""
    test = _ANSI.sub("", test).split(" - ")[0].strip()
    return ".".join(test.split("::")[1:]) if "::" in test else test


def grade_expected(statuses: dict[str, str], expected: dict[str, str]) -> tuple[bool, dict[str, bool]]:
    """(resolved, {expected test: its status matches}) of parsed `statuses` against R2E-Gym's expectation:
    resolved only when the parsed tests are exactly the expected ones, each with the expected status."""
    parsed = {r2e_key(k): v for k, v in statuses.items()}
    matches = {test: parsed.get(test) == status for test, status in expected.items()}
    return set(parsed) == set(expected) and all(matches.values()), matches


def reverse_patch(patch: str) -> str:
    """A unified git diff that undoes `patch`: sides, hunks, index ids, modes and creation/deletion swapped."""
    out: list[str] = []
    lines = patch.splitlines(keepends=True)
    i, old_left, new_left = 0, 0, 0
    while i < len(lines):
        line = lines[i]
        if old_left > 0 or new_left > 0:  # inside a hunk: counted, so "--- x" here is a removed line
            sign = line[:1]
            old_left -= sign in " -"
            new_left -= sign in " +"
            out.append({"+": "-", "-": "+"}.get(sign, sign) + line[1:] if sign in "+-" else line)
        elif hunk := re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$", line, re.DOTALL):
            a, b, c, d, tail = hunk.groups()
            old_left, new_left = int(b if b is not None else 1), int(d if d is not None else 1)
            out.append(f"@@ -{c}{',' + d if d is not None else ''} +{a}{',' + b if b is not None else ''} @@{tail}")
        elif line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            out += ["--- " + re.sub(r"^b/", "a/", new), "+++ " + re.sub(r"^a/", "b/", old)]
            i += 1
        elif m := re.match(r"diff --git a/(\S+) b/(\S+)(\s*)$", line):
            out.append(f"diff --git a/{m.group(2)} b/{m.group(1)}{m.group(3)}")
        elif m := re.match(r"index (\w+)\.\.(\w+)(.*)$", line, re.DOTALL):
            out.append(f"index {m.group(2)}..{m.group(1)}{m.group(3)}")
        else:
            key = next((k for k in _SWAPPED if line.startswith(k + " ")), None)
            out.append(_SWAPPED[key] + line[len(key) :] if key else line)
        i += 1
    return "".join(out)


_SWAPPED = {
    "new file mode": "deleted file mode",
    "deleted file mode": "new file mode",
    "old mode": "new mode",
    "new mode": "old mode",
    "rename from": "rename to",
    "rename to": "rename from",
}
