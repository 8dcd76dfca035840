"""Builds SWE-bench-style task sets from a pure-Python project's sdist on PyPI.

    pip download --no-deps --no-binary :all: PKG==VER ──> sdist ──> git repo, commit "upstream"
    for each candidate mutation (a comparison operator flipped, seeded order):
        upstream + mutation - held-out test files ──> commit = base_commit (branch instances/<id>)
        run the test files on upstream and on the mutant (pytest -rA) and parse both logs
        FAIL_TO_PASS = passed upstream, fail with the mutation; PASS_TO_PASS = a sample passing both
        keep it if FAIL_TO_PASS is not empty
    ──> OUT/instances.jsonl + OUT/repos/pypi__PKG.git (bare mirror)

It is a command of its own, `python -m services.sandbox.task_builder NAME==VERSION --out DIR
--module SRC.py --test-file TEST.py`, which `dockyard tasks build-swe` runs in a child process
(the library does not import the services); the exit status is 0 when at least one instance was
written, 1 when none was or the build failed (the message on stderr), 2 for a usage error.
It reads test logs with the sandbox's own parser and writes mirrors where the sandbox looks for
them, so FAIL_TO_PASS and PASS_TO_PASS mean what the sandbox's grading takes them to mean.

Each instance's gold `patch` is the reverse of the mutation (source files only) and its
`test_patch` restores the held-out test files, so the tests that judge a solution are not in the
checkout the policy sees. The project ships this builder, never third-party source: task sets
are made where they are used. The test runs here are trusted host-side operations on the
project's own, unmodified tests (plus the mutation).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.log_parsing import parse_log
from services.sandbox.swe import mirror_name

# Flipped comparison operators (op text -> mutant text); both sides are single tokens.
_FLIPS = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
}
TEST_CMD = ["pytest", "-rA", "--tb=no", "-p", "no:cacheprovider"]
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "dockyard",
    "GIT_AUTHOR_EMAIL": "dockyard@localhost",
    "GIT_COMMITTER_NAME": "dockyard",
    "GIT_COMMITTER_EMAIL": "dockyard@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the project root
    lineno: int
    function: str
    before: str  # the whole line
    after: str


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo)}
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def download_sdist(package: str, version: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest), spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {spec} failed: {done.stderr.strip()[-1000:]}")
    found = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
    if not found:
        raise RuntimeError(f"pip download {spec} produced no source distribution in {dest}")
    return found[0]


def unpack(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise RuntimeError(f"{sdist.name}: expected one top-level folder, found {[p.name for p in tops]}")
    return tops[0]


def mutations(root: Path, path: str) -> list[Mutation]:
    """Every single-operator comparison flip in `path` that stays on one line."""
    source = (root / path).read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    found: list[Mutation] = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Compare) or len(node.ops) != 1 or type(node.ops[0]) not in _FLIPS:
                continue
            left, right = node.left, node.comparators[0]
            if left.end_lineno != right.lineno or node.lineno != node.end_lineno:
                continue
            line = lines[node.lineno - 1]
            start, end = left.end_col_offset, right.col_offset
            gap = line.encode()[start:end].decode()
            op, flipped = _FLIPS[type(node.ops[0])]
            if gap.count(op) != 1 or re.sub(r"[\s()]", "", gap) != op:
                continue
            new_gap = gap.replace(op, flipped)
            head, tail = line.encode()[:start].decode(), line.encode()[end:].decode()
            found.append(Mutation(path, node.lineno, func.name, line, head + new_gap + tail))
    unique = {(m.lineno, m.after): m for m in found}  # nested functions are walked twice
    return sorted(unique.values(), key=lambda m: (m.lineno, m.after))


def run_tests(root: Path, test_files: list[str], timeout: float) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", TEST_CMD[0], *TEST_CMD[1:], *test_files],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **_src_layout(root)},
    )
    return parse_log("parse_log_pytest", done.stdout)


def _src_layout(root: Path) -> dict[str, str]:
    """PYTHONPATH for a project whose packages live under src/ (the tests import them from there)."""
    if not (root / "src").is_dir():
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH", "")]))}


def _apply(root: Path, mutation: Mutation, *, reverse: bool = False) -> None:
    target = root / mutation.path
    lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
    old, new = (mutation.after, mutation.before) if reverse else (mutation.before, mutation.after)
    if lines[mutation.lineno - 1] != old:
        raise RuntimeError(f"{mutation.path}:{mutation.lineno} is not what the mutation expects")
    lines[mutation.lineno - 1] = new
    target.write_text("".join(lines), encoding="utf-8")


def build(
    package: str,
    version: str,
    out: Path,
    *,
    modules: list[str],
    test_files: list[str],
    max_instances: int = 3,
    max_candidates: int = 40,
    max_pass_to_pass: int = 20,
    seed: int = 0,
    sdist: Path | None = None,
    test_timeout: float = 300.0,
) -> list[dict]:
    """Write OUT/instances.jsonl and OUT/repos/pypi__<package>.git; return the instances."""
    out.mkdir(parents=True, exist_ok=True)
    repo_name = f"pypi/{package}"
    rng = random.Random(f"{package}=={version}:{seed}")
    with tempfile.TemporaryDirectory(prefix="dockyard-build-swe-") as tmp_name:
        tmp = Path(tmp_name)
        sdist = sdist or download_sdist(package, version, tmp / "dl")
        root = unpack(sdist, tmp / "src")
        for path in [*modules, *test_files]:
            if not (root / path).is_file():
                raise FileNotFoundError(f"{path} is not in the {package} {version} sdist")
        git(root, "init", "--quiet", "--initial-branch=upstream")
        git(root, "add", "--all", "--force")
        git(root, "commit", "--quiet", "-m", f"{package} {version} from its source distribution")
        upstream = git(root, "rev-parse", "HEAD").strip()
        try:
            baseline = run_tests(root, test_files, test_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the tests of unmodified {package} {version} ran past {test_timeout} s") from None
        if not any(s == "PASSED" for s in baseline.values()):
            raise RuntimeError(f"no test of {test_files} passes on unmodified {package} {version}")
        candidates = [m for path in modules for m in mutations(root, path)]
        rng.shuffle(candidates)
        instances: list[dict] = []
        for mutation in candidates[:max_candidates]:
            if len(instances) >= max_instances:
                break
            _apply(root, mutation)
            try:
                statuses = run_tests(root, test_files, test_timeout)
            except subprocess.TimeoutExpired:
                statuses = None
            _apply(root, mutation, reverse=True)
            if statuses is None:
                continue
            passing = sorted(t for t, s in baseline.items() if s == "PASSED")
            f2p = [t for t in passing if statuses.get(t) not in ("PASSED", "XFAIL")]
            p2p_all = [t for t in passing if statuses.get(t) == "PASSED"]
            if not f2p:
                continue
            p2p = sorted(rng.sample(p2p_all, min(max_pass_to_pass, len(p2p_all))))
            instance_id = f"{package}-{version}-{mutation.function}-L{mutation.lineno}".replace("/", "_")
            # base_commit: the bug in, the held-out test files out.
            git(root, "checkout", "--quiet", "-b", f"instances/{instance_id}", upstream)
            _apply(root, mutation)
            git(root, "rm", "--quiet", "--", *test_files)
            git(root, "commit", "--quiet", "--all", "-m", f"{instance_id}: base")
            base = git(root, "rev-parse", "HEAD").strip()
            gold = git(root, "diff", "--no-color", "--no-ext-diff", base, upstream, "--", *modules)
            test_patch = git(root, "diff", "--no-color", "--no-ext-diff", base, upstream, "--", *test_files)
            git(root, "checkout", "--quiet", "upstream")
            instances.append(
                {
                    "instance_id": instance_id,
                    "repo": repo_name,
                    "version": version,
                    "base_commit": base,
                    "patch": gold,
                    "test_patch": test_patch,
                    "FAIL_TO_PASS": f2p,
                    "PASS_TO_PASS": p2p,
                    "problem_statement": (
                        f"{package} {version}: `{mutation.function}` in `{mutation.path}` returns wrong results "
                        f"for some inputs (a condition is wrong). Fix the bug; do not change the tests."
                    ),
                    "test_cmd": [*TEST_CMD, *test_files],
                    "log_parser": "pytest",
                    "requirements": [f"pytest=={_pytest_version()}"],
                }
            )
        mirror = out / "repos" / mirror_name(repo_name)
        if mirror.exists():
            shutil.rmtree(mirror)
        mirror.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "--quiet", "--mirror", str(root), str(mirror)], check=True)
    with (out / "instances.jsonl").open("w", encoding="utf-8") as f:
        for instance in instances:
            f.write(json.dumps(instance) + "\n")
    return instances


def _pytest_version() -> str:
    from importlib.metadata import version

    return version("pytest")


def _name_version(text: str) -> tuple[str, str]:
    package, sep, version = text.partition("==")
    if not sep or not package or not version:
        raise argparse.ArgumentTypeError(f"package must be NAME==VERSION, got {text!r}")
    return package, version


def main(argv: list[str] | None = None) -> int:
    # `--prog` names the command in usage and errors: `dockyard tasks build-swe` runs this as a process.
    prog = "python -m services.sandbox.task_builder"
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--prog"] and len(argv) > 1:
        prog, argv = argv[1], argv[2:]
    parser = argparse.ArgumentParser(
        prog=prog, description="SWE-bench-style instances from a PyPI sdist with injected bugs"
    )
    parser.add_argument(
        "package", type=_name_version, help="NAME==VERSION of a pure-Python project whose sdist ships its tests"
    )
    parser.add_argument("--out", required=True, help="task-set folder to write (instances.jsonl, repos/)")
    parser.add_argument("--module", action="append", required=True, help="source file to mutate (repeatable)")
    parser.add_argument("--test-file", action="append", required=True, help="test file to run (repeatable)")
    parser.add_argument("--max-instances", type=int, default=3, help="stop after this many instances")
    parser.add_argument("--max-candidates", type=int, default=40, help="mutations tried at most")
    parser.add_argument("--seed", type=int, default=0, help="order in which mutations are tried")
    parser.add_argument("--sdist", help="use this sdist file instead of downloading it")
    args = parser.parse_args(argv)
    package, version = args.package
    try:
        made = build(
            package,
            version,
            Path(args.out),
            modules=args.module,
            test_files=args.test_file,
            max_instances=args.max_instances,
            max_candidates=args.max_candidates,
            seed=args.seed,
            sdist=Path(args.sdist) if args.sdist else None,
        )
    except (OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for instance in made:
        print(
            f"{instance['instance_id']}: {len(instance['FAIL_TO_PASS'])} FAIL_TO_PASS, "
            f"{len(instance['PASS_TO_PASS'])} PASS_TO_PASS"
        )
    print(f"{len(made)} instance(s) in {args.out}/instances.jsonl")
    return 0 if made else 1


if __name__ == "__main__":
    sys.exit(main())
