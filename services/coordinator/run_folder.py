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
With a run root (DOCKYARD_COORDINATOR_RUN_ROOT), `confine` keeps every job's
run folder and checkpoints inside it, symlinks resolved, or refuses the job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dockyard.config import MasterConfig
from dockyard.rpc.errors import InvalidArgument


def confine(config: MasterConfig, root: str) -> MasterConfig:
    """`config` with logger.log_dir (and an explicit checkpointing.checkpoint_dir) as absolute folders
    inside `root`, relative ones taken under it; InvalidArgument naming the field if one lies outside."""
    if not root:
        return config
    base = Path(root).resolve()

    def inside(field: str, value: str) -> str:
        folder = (base / value).resolve()  # an absolute value replaces base; symlinks are followed
        if not folder.is_relative_to(base):
            raise InvalidArgument(
                f"{field} {value!r} lies outside this coordinator's run root {base} (DOCKYARD_COORDINATOR_RUN_ROOT)"
            )
        return str(folder)

    logger = config.logger.model_copy(update={"log_dir": inside("logger.log_dir", config.logger.log_dir)})
    update = {"logger": logger}
    if config.checkpointing.checkpoint_dir is not None:
        checkpoint_dir = inside("checkpointing.checkpoint_dir", config.checkpointing.checkpoint_dir)
        update["checkpointing"] = config.checkpointing.model_copy(update={"checkpoint_dir": checkpoint_dir})
    return config.model_copy(update=update)


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
