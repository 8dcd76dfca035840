"""SWE-bench's per-repository, per-version environment specifications -> an offline recipe, or a refusal.

    row (repo, version, instance_id) ──swebench_specs.json[repo][version]──> spec
        python, pip_packages, packages, install, test_cmd, pre_install, eval_commands
    spec ──recipe()──> EnvRecipe: what the environment image installs (pip packages, the repository's
                       requirements file, `pip install [-e] .[extras]`) and the test command
        or SpecRefused naming the instance, the repo/version and the step that cannot run offline

The table is swebench's MAP_REPO_VERSION_TO_SPECS_PY and MAP_REPO_TO_REQS_PATHS as swebench 4.1.0
ships them (`swebench/harness/constants/python.py`, MIT), kept as data in swebench_specs.json:
swebench 5 no longer carries the table (its datasets name a prebuilt image per instance instead),
and one interpreter cannot import two swebench releases.

Guarantees: a recipe is returned only for a spec whose every step can run from a wheelhouse with
no network: pip packages (`pip_packages`, and `packages` when it names packages, as conda names
match PyPI's for these), the repository's requirements file (`packages: requirements.txt`, read
from the mirror at environment_setup_commit), and an install command of the form
`python -m pip install [-e] [--no-build-isolation] [-v] .[extras]`. Refused, with the step named:
a repository or version the table lacks, `pre_install` (apt and other system steps),
`packages: environment.yml` (conda), any other install command (`setup.py install`, chains),
`eval_commands`, a missing test command. The spec's `python` is recorded, not provided: the
environment image has the sandbox image's Python (3.11).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SPECS_FILE = Path(__file__).with_name("swebench_specs.json")
_INSTALL_FLAGS = {"-e", "--editable", "--no-build-isolation", "-v", "--verbose"}
_TARGET = re.compile(r"^\.(\[[A-Za-z0-9_,.-]+\])?$")


class SpecRefused(ValueError):
    """An instance whose environment cannot be built offline from swebench's specification."""


@dataclass(frozen=True)
class EnvRecipe:
    repo: str
    version: str
    python: str  # what the spec asks for; the image's Python is the sandbox image's
    pip_packages: tuple[str, ...]  # installed first, in this order
    requirements_paths: tuple[str, ...]  # the first one the repository has is installed (-r)
    install_flags: tuple[str, ...]  # of `pip install`: -e, --no-build-isolation, ...
    install_target: str  # "." or ".[extras]"
    test_cmd: tuple[str, ...]  # without the test files
    spec_hash: str  # of the spec as the table holds it

    @property
    def editable(self) -> bool:
        return bool({"-e", "--editable"} & set(self.install_flags))


@functools.cache
def specs_table() -> dict:
    return json.loads(SPECS_FILE.read_text(encoding="utf-8"))


def covered(repo: str) -> bool:
    """Whether swebench's table has specifications for `repo` (owner/name)."""
    return repo in specs_table()["specs"]


def spec_for(instance_id: str, repo: str, version: str) -> dict:
    """The table's spec for (repo, version); SpecRefused naming what is missing and what exists."""
    specs = specs_table()["specs"]
    where = f"instance {instance_id!r} ({repo} version {version!r})"
    if repo not in specs:
        raise SpecRefused(f"{where}: swebench's specifications do not cover {repo}; covered: {sorted(specs)}")
    if version not in specs[repo]:
        known = sorted(specs[repo], key=lambda v: [int(p) if p.isdigit() else p for p in v.split(".")])
        raise SpecRefused(f"{where}: swebench has no specification for this version; its versions: {known}")
    return specs[repo][version]


def spec_test_cmd(repo: str, version: str) -> str | None:
    """The test command of the table's spec for (repo, version); None when it has none (a prebuilt
    image's row may still name one itself, swe_formats.py)."""
    cmd = specs_table()["specs"].get(repo, {}).get(version, {}).get("test_cmd")
    return cmd if isinstance(cmd, str) else None


def recipe(instance_id: str, repo: str, version: str) -> EnvRecipe:
    """The offline recipe for an instance; SpecRefused names the instance, repo/version and the step."""
    spec = spec_for(instance_id, repo, version)
    where = f"instance {instance_id!r} ({repo} version {version!r})"

    def refuse(step: str, why: str) -> SpecRefused:
        return SpecRefused(f"{where}: step {step!r} cannot run offline: {why}")

    if spec.get("pre_install"):
        raise refuse("pre_install", f"system packages or downloads ({spec['pre_install'][0][:120]!r}...)")
    if spec.get("eval_commands"):
        raise refuse("eval_commands", f"commands before the tests ({spec['eval_commands'][0][:120]!r}...)")
    packages = str(spec.get("packages") or "").strip()
    requirements_paths: tuple[str, ...] = ()
    extra: list[str] = []
    if packages == "environment.yml":
        raise refuse("packages", "a conda environment.yml (conda is not available; only pip wheels are)")
    if packages == "requirements.txt":
        requirements_paths = tuple(specs_table()["requirements_paths"].get(repo, ()))
        if not requirements_paths:
            raise refuse("packages", "requirements.txt, but swebench names no requirements file for this repo")
    elif packages:
        extra = shlex.split(packages)  # conda package names, which are PyPI's for these
    flags, target = _install(spec.get("install"), refuse)
    test_cmd = spec.get("test_cmd")
    if not isinstance(test_cmd, str) or not test_cmd.strip():
        raise refuse("test_cmd", f"the spec has no single test command ({test_cmd!r})")
    return EnvRecipe(
        repo=repo,
        version=version,
        python=str(spec.get("python", "")),
        pip_packages=tuple([*spec.get("pip_packages", []), *extra]),
        requirements_paths=requirements_paths,
        install_flags=flags,
        install_target=target,
        test_cmd=tuple(shlex.split(test_cmd)),
        spec_hash=hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16],
    )


def _install(command: object, refuse) -> tuple[tuple[str, ...], str]:
    """`python -m pip install [flags] .[extras]` -> (flags, target); anything else is refused."""
    if not command:
        raise refuse("install", "the spec has no install command")
    try:
        words = shlex.split(str(command))
    except ValueError as exc:
        raise refuse("install", f"{command!r} does not parse: {exc}") from None
    head = 3 if words[:3] == ["python", "-m", "pip"] else 1 if words[:1] == ["pip"] else 0
    rest = words[head + 1 :] if head and words[head : head + 1] == ["install"] else None
    targets = [w for w in rest or [] if w not in _INSTALL_FLAGS and w != "--no-use-pep517"]
    if rest is None or len(targets) != 1 or not _TARGET.match(targets[0]):
        raise refuse("install", f"{command!r} is not `python -m pip install [-e] .[extras]`")
    flags = tuple(w for w in rest if w in _INSTALL_FLAGS)
    return flags, targets[0]
