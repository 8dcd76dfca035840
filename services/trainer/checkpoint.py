"""Checkpoint folders: atomic saves, the latest one, top-k retention.

    <checkpoint_dir>/step-<N>/            Hugging Face folder (config.json, model.safetensors, tokenizer)
                       trainer_state.pt   optimizer, scheduler, RNG of every rank, step, weight version,
                                          the coordinator's data position
                       checkpoint.json    step, weight version, validation metrics, format (written last)
                       adapter/           policy.lora: peft's adapter folder (the HF folder holds the merge)
    checkpointing.format=sharded: config.json + tokenizer, trainer_state.pt and checkpoint.json as above,
                       and dcp/ (torch.distributed.checkpoint: every rank's shards of the model and the
                       optimizer, no HF weights; `dockyard export hf` makes an HF folder of it)
    <checkpoint_dir>/.step-<N>.tmp-<pid>/ a save in progress; never read
    <checkpoint_dir>/.step-<N>.old-<pid>/ a checkpoint being deleted; never read

Guarantees: `folder_for` names the folders that `complete_checkpoints` reads
back. A checkpoint is written under a temporary name and renamed into place in
one step, so a crash mid-save leaves at most a temporary folder that
`complete_checkpoints` ignores; only folders holding checkpoint.json count, so
`latest` is always a whole checkpoint. A checkpoint is deleted (replaced by a
save of the same step, or retired by `retain`) by renaming it aside first, so a
crash mid-delete never leaves a partial folder that counts. `retain` keeps the
latest checkpoint (resume needs it) plus the k best by the named metric, and
deletes the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
_NAME = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    meta: dict[str, Any]

    def metric(self, name: str) -> float | None:
        value = self.meta.get("metrics", {}).get(name)
        return None if value is None else float(value)


def folder_for(root: Path, version: int) -> Path:
    """The folder of the checkpoint taken at weight version (step) `version` under `root`."""
    return root / f"step-{version}"


def write_atomically(folder: Path, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Run `write(tmp)` into a fresh, empty folder, add checkpoint.json, then rename tmp to `folder` (replacing
    an old one)."""
    tmp = staging_folder(folder)
    write(tmp)
    return publish(tmp, folder, meta)


def staging_folder(folder: Path) -> Path:
    """A fresh, empty temporary folder beside `folder`, which `publish` renames into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, folder: Path, meta: dict[str, Any]) -> Path:
    """Add checkpoint.json (written last) to the staged `tmp` and rename it to `folder`."""
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    # Same step saved again (a recovered job's final save): the old one goes aside, not away, until
    # the new one is in place.
    aside = _move_aside(folder) if folder.exists() else None
    tmp.rename(folder)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return folder


def _move_aside(folder: Path) -> Path:
    """Take `folder` out of the complete checkpoints in one rename; returns where it went."""
    aside = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    folder.rename(aside)
    return aside


def complete_checkpoints(root: Path) -> list[Checkpoint]:
    """Whole checkpoints under `root`, oldest step first."""
    found = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / META_FILE).is_file():
            found.append(Checkpoint(int(match.group(1)), child, json.loads((child / META_FILE).read_text())))
    return sorted(found, key=lambda c: c.step)


def latest(root: Path) -> Checkpoint | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def retain(root: Path, keep_top_k: int | None, metric_name: str, higher_is_better: bool) -> list[Path]:
    """Delete all but the latest and the `keep_top_k` best checkpoints; returns what was deleted."""
    found = complete_checkpoints(root)
    if keep_top_k is None or not found:
        return []
    sign = 1.0 if higher_is_better else -1.0
    # Only measured checkpoints compete for the top k; ties go to the newer step.
    measured = [c for c in found if c.metric(metric_name) is not None]
    best = sorted(measured, key=lambda c: (sign * c.metric(metric_name), c.step), reverse=True)[:keep_top_k]
    keep = {c.path for c in best} | {found[-1].path}
    removed = []
    for c in found:
        if c.path not in keep:
            shutil.rmtree(_move_aside(c.path), ignore_errors=True)
            removed.append(c.path)
    return removed
