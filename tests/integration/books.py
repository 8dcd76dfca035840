"""The books of a finished run, as every kill test checks them.

- the trainer's ledger names no group and no trajectory twice (none trained twice);
- every group the collector finished is in the buffer's count exactly once, and
  every accepted group was trained on, dropped as stale (counted) or is still
  held or pending at the end: puts == trained + dropped_stale + held + pending;
- every trained sample is within the age bound.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.trainer.ledger import read_ledger


def assert_accounted(run_dir: Path, max_age: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    ledger = read_ledger(run_dir / "checkpoints")
    trained = [gid for line in ledger for gid in line["group_ids"]]
    trajectories = [tid for line in ledger for tid in line["trajectory_ids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert len(trajectories) == len(set(trajectories)), "a trajectory was trained twice"
    accepted = {g["group_id"] for g in groups if g["outcome"] in ("put", "dropped_stale", "duplicate")}
    assert set(trained) <= accepted, "the trainer trained a group the collector never put"
    buffer = [r for r in records if r["kind"] == "buffer"][-1]
    assert buffer["buffer_puts"] == len(accepted)
    assert buffer["buffer_acked"] == len(trained)
    assert (
        len(accepted)
        == len(trained) + buffer["buffer_dropped_stale"] + buffer["buffer_held"] + buffer["buffer_pending"]
    )
    for r in records:
        if r["kind"] == "train":
            ages = [int(k.removeprefix("staleness_")) for k in r if k.removeprefix("staleness_").isdigit()]
            assert ages and max(ages) <= max_age, r
    return {"records": records, "ledger": ledger}
