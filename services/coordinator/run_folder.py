"""The run folder of a job: resolved config, metrics.jsonl, curves.

    runs/<job-id>/config.yaml       the exact config the job ran with
    runs/<job-id>/metrics.jsonl     one JSON object per step ("kind": "train"), per validation
                                    ("kind": "validation"), per Generate call ("kind": "generation":
                                    replica, group, start/end, weight version, tokens) and the
                                    buffer's final counts ("kind": "buffer")
    runs/<job-id>/groups.jsonl      one line per group the collector finished: id, outcome
                                    (put, duplicate, dropped_stale, dropped_uniform, failed), weight version
    runs/<job-id>/curves.png        reward per step and validation pass rate
    runs/<job-id>/job.json          the job store's document (services/coordinator/store.py), not written here

Guarantees: every line of metrics.jsonl and groups.jsonl is a complete JSON
object, flushed when written, so a reader (or a crash) never sees half a record.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class RunFolder:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = path / "metrics.jsonl"

    def write_config(self, resolved_yaml: str) -> None:
        (self.path / "config.yaml").write_text(resolved_yaml)

    def append(self, kind: str, step: int, values: dict[str, float | int | str]) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def record_group(self, group_id: str, outcome: str, weight_version: int) -> None:
        record = {"group_id": group_id, "outcome": outcome, "weight_version": weight_version, "time": time.time()}
        with (self.path / "groups.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        train = [r for r in records if r["kind"] == "train"]
        val = [r for r in records if r["kind"] == "validation"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(
            [r["step"] for r in train],
            [r.get("reward_mean", float("nan")) for r in train],
            label="train reward (mean)",
            color="tab:blue",
            alpha=0.8,
        )
        ax.plot(
            [r["step"] for r in val],
            [r.get("pass_rate", float("nan")) for r in val],
            "o-",
            label="validation pass rate",
            color="tab:orange",
        )
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        ax.set_title(f"job {self.path.name}")
        out = self.path / "curves.png"
        fig.tight_layout()
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
