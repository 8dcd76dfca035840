"""Row formats of SWE datasets that ship a prebuilt image per row -> the image, its layout, its test command.

    <task set>/dataset.json {"format": NAME}  (optional; wins over detection)
    or the columns of the first row ──detect──> swe-bench | swe-gym | swe-rebench | swe-smith | r2e-gym | None
    (format, row) ──prebuilt_env──> PrebuiltEnv(image, repo_dir, env_bin)  or  FormatRefused
    (format, row, spec table) ──prebuilt_test_cmd──> argv (without the test files)

Formats (the columns read, the image rule):
- swe-bench: SWE-bench's columns; the image is its harness's eval image of the instance,
  `swebench/sweb.eval.x86_64.<instance_id, "__" -> "_1776_", lower case>:latest`. Named in
  dataset.json only: the same columns without it keep the spec-built environment (swe_specs.py).
- swe-gym: SWE-bench's columns; the image is `xingyaoww/sweb.eval.x86_64.<instance_id, "__" ->
  "_s_", lower case>:latest`, as SWE-Gym's published images are named. Named in dataset.json only.
- swe-rebench: detected by `docker_image` + `install_config`; the image is `docker_image`, the test
  command `install_config.test_cmd` (else `test_cmd`), the parser `install_config.log_parser` if set.
- swe-smith (`image_name`) and r2e-gym (`docker_image` without `install_config`): recognised and
  refused (FormatRefused says why): SWE-smith rows hold the bug as `patch` on a commit of its own
  mirror and no base_commit; R2E-Gym runs its own test files (/r2e_tests) with no FAIL_TO_PASS lists.

The images of swe-bench, swe-gym and swe-rebench lay the repository out at /testbed with a conda
environment `testbed` (/opt/miniconda3/envs/testbed); an image's own `image_name`, `docker_image`
or `test_cmd` column is read as it is. The test command of a swe-bench or swe-gym row is the row's
`test_cmd`, else its (repo, version) spec's in swebench's table; neither: FormatRefused.

Guarantees: detection is by columns only and is the same for every row of a task set (the first
row decides; a row of another format is refused by name at load); every refusal names the
instance, the format and what is missing.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("swe-bench", "swe-gym", "swe-rebench", "swe-smith", "r2e-gym")
FORMAT_FILE = "dataset.json"
REPO_DIR = "/testbed"  # where the images of SWE-bench's harness (and its forks) hold the repository
ENV_BIN = "/opt/miniconda3/envs/testbed/bin"  # their conda environment, first on PATH for the tests


class FormatRefused(ValueError):
    """A row whose format dockyard cannot score; the message names the instance, the format and why."""


@dataclass(frozen=True)
class PrebuiltEnv:
    image: str  # as the dataset names it (a registry prefix is the deployment's, swe_prebuilt.py)
    repo_dir: str  # where the image's environment expects the repository
    env_bin: str  # prepended to PATH for the test command


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


def prebuilt_env(fmt: str, row: dict) -> PrebuiltEnv:
    """The image and layout of `row` in format `fmt`; FormatRefused for a format that cannot be scored."""
    iid = str(row.get("instance_id") or row.get("docker_image") or "?")
    if fmt == "swe-smith":
        raise FormatRefused(
            f"instance {iid!r}: format swe-smith (image_name {row.get('image_name')!r}) is not scored: its row "
            "holds the bug as `patch` against a commit of SWE-smith's own mirror and no base_commit"
        )
    if fmt == "r2e-gym":
        raise FormatRefused(
            f"instance {iid!r}: format r2e-gym (docker_image {row.get('docker_image')!r}) is not scored: it runs "
            "its own test files from /r2e_tests and carries no FAIL_TO_PASS / PASS_TO_PASS lists"
        )
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
