"""`dockyard prepare`: build the policy folder a recipe bootstraps (its warm start), only when it is missing.

A folder that exists is kept as it is; where it was built with other settings than the config's bootstrap,
the differences are named.
"""

from __future__ import annotations

import json
from pathlib import Path


def prepare(cfg) -> None:
    """Run the config's bootstrap when policy.model_name does not exist yet."""
    policy = cfg.policy
    if policy.bootstrap is None or policy.model_name is None:
        return
    out = Path(policy.model_name)
    if (out / "config.json").is_file():
        print(f"{out} exists: kept as it is (prepare builds a missing policy folder only; delete it to build it again)")
        if differences := bootstrap_differences(out, policy, demonstrated_families(cfg)):
            print(f"note: {out} was built with other settings than the config's bootstrap: {differences}")
        return
    print(f"{out} does not exist: building it with the config's bootstrap ({policy.bootstrap.recipe} warm start)")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dockyard.recipes.tiny_agent import warm_start_agent
    from dockyard.recipes.tiny_expr import warm_start

    boot = policy.bootstrap
    build = warm_start_agent if boot.recipe == "tiny_agent" else warm_start
    # Demonstrations of the job's training tasks; the agent's in its scaffold's format.
    extra = {"families": demonstrated_families(cfg), "answer": boot.answer}
    if boot.recipe == "tiny_agent":
        extra |= {"scaffold": boot.scaffold, "reads": boot.reads, "shortcut_reads": boot.shortcut_reads}
    else:
        extra |= {"chat": boot.chat}
    with Progress(
        TextColumn("warm start"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    ) as bar:
        task = bar.add_task("sft", total=boot.steps, loss="-")
        build(
            out,
            model=policy.model or {},
            steps=boot.steps,
            lr=boot.lr,
            batch_size=boot.batch_size,
            seed=boot.seed,
            num_threads=boot.num_threads,
            shortcut_rate=boot.shortcut_rate,
            **extra,
            progress=lambda step, loss: bar.update(task, completed=step, loss=f"{loss:.3f}"),
        )
    print(f"policy written to {out}")


def demonstrated_families(cfg) -> list[str]:
    """The function families the warm start demonstrates: the bootstrap's own, else the job's training tasks'."""
    return cfg.policy.bootstrap.families or cfg.data.train.families


def bootstrap_differences(folder: Path, policy, families=()) -> str:
    """The settings a warm-start folder was built with (its warm_start.json) that differ from the
    config's bootstrap (and `families`, the training tasks' function families), as `key: built ->
    config`; "" when they agree or the folder has no record."""
    meta_path = folder / "warm_start.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return ""
    boot = policy.bootstrap
    wanted = {
        name: getattr(boot, name)
        for name in ("recipe", "steps", "lr", "batch_size", "seed", "shortcut_rate", "scaffold", "chat", "answer")
    }
    wanted["families"] = list(families)
    if boot.recipe == "tiny_agent":
        wanted |= {"reads": boot.reads, "shortcut_reads": boot.shortcut_reads}
    wanted |= {f"model.{k}": v for k, v in (policy.model or {}).items()}
    built = {**meta, **{f"model.{k}": v for k, v in (meta.get("model") or {}).items()}}
    return ", ".join(
        f"{key}: {built[key]!r} -> {value!r}" for key, value in wanted.items() if key in built and built[key] != value
    )
