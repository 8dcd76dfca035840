"""The trainer's ledger of trained groups: what makes "trained at most once" survive a crash.

One JSON line per optimizer step (step, weight version, group ids, trajectory
ids), appended and fsynced after the step and before its groups are acked, in
the job's checkpoint folder. A trainer restarted after a crash reclaims the
groups its predecessor left pending; a reclaimed group the ledger names was
trained by a step whose ack was lost, so it is acked, never trained again.

Guarantees: a line is either whole or ignored (a torn last line from a crash
is skipped on load), and `record` returns only once the line is on disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import structlog

log = structlog.get_logger()

LEDGER_NAME = "trained_groups.jsonl"


class TrainedLedger:
    def __init__(self, folder: Path) -> None:
        self.path = folder / LEDGER_NAME
        self.trained: set[str] = set()
        if self.path.exists():
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    self.trained.update(json.loads(line)["group_ids"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    log.warning("skipping a torn ledger line", path=str(self.path), line=n)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.trained

    def record(self, step: int, weight_version: int, group_ids: Sequence[str], trajectory_ids: Sequence[str]) -> None:
        line = json.dumps(
            {
                "step": step,
                "weight_version": weight_version,
                "group_ids": list(group_ids),
                "trajectory_ids": list(trajectory_ids),
            }
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.trained.update(group_ids)


def read_ledger(folder: Path) -> list[dict]:
    """Every whole line of a ledger, in order (for accounting and tests)."""
    path = folder / LEDGER_NAME
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return lines
