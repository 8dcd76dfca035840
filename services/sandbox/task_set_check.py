"""`python -m services.sandbox.task_set_check FOLDER...`: load SWE task sets as the sandbox will, or say why not.

    FOLDER (instances.jsonl | instances.parquet, repos/) ──TaskSets.instances──> "N instances" (exit 0)
                                                        └─> the refusal (exit 1): line, instance, repo/version, step

Guarantees: the same loader and checks as ScorePatch's first call (the row format, swebench's specs,
the mirror's commits and requirements files), without building or pulling an image or running a test; a child process of
`dockyard preflight`, so the library never imports the services. Exit 2: usage.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.sandbox.swe import TaskSetError, TaskSets


def check(folder: Path) -> str:
    """'<folder>: N instances (M with swebench specs)'; TaskSetError says why it cannot load."""
    instances = TaskSets(str(folder.parent)).instances(folder.name)
    with_specs = sum(1 for i in instances.values() if i.recipe is not None)
    prebuilt = sum(1 for i in instances.values() if i.prebuilt is not None)
    own = f", {prebuilt} in their dataset's prebuilt images" if prebuilt else ""
    return f"{folder}: {len(instances)} instances ({with_specs} run by swebench's specs{own})"


def main(argv: list[str] | None = None) -> int:
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        print("usage: python -m services.sandbox.task_set_check FOLDER...", file=sys.stderr)
        return 2
    failed = False
    for folder in folders:
        try:
            print(check(Path(folder).resolve()))
        except TaskSetError as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
