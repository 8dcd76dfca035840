"""The run folder of a job: resolved config, metrics.jsonl, curves.

    runs/<job-id>/config.yaml       the exact config the job ran with
    runs/<job-id>/metrics.jsonl     one JSON object per step ("kind": "train"), per validation
                                    ("kind": "validation"), per Generate call ("kind": "generation":
                                    replica, group, start/end, weight version, tokens) and the
                                    buffer's final counts ("kind": "buffer")
    runs/<job-id>/groups.jsonl      one line per group the collector finished: id, outcome
                                    (put, duplicate, dropped_stale, dropped_uniform, refused, failed), weight
                                    version; a failed group's `error`: its first failed trajectory and why
    runs/<job-id>/samples.jsonl     a few completions per step (logger.num_samples_per_step): prompt,
                                    completion, reward, verdict
    runs/<job-id>/trials.jsonl      logger.save_trials: every passing training trial whole: ids, reward, and
                                    the prompt and completion (single-turn), or per conversation segment its
                                    messages and tools (agent trials)
    runs/<job-id>/curves.png        one panel per metric family the run reports (reward, validation,
                                    loss, KL, entropy, clip fraction, staleness, tokens/s), rewritten
                                    as the run goes
    runs/<job-id>/{wandb,tensorboard,mlruns,swanlog}   the enabled trackers' local files
                                    (dockyard/monitoring/trackers.py gets every record written here)
    runs/<job-id>/job.json          the job store's document (services/coordinator/store.py), not written here

Guarantees: every line of metrics.jsonl, groups.jsonl, samples.jsonl and trials.jsonl is a
complete JSON object, flushed when written, so a reader (or a crash) never sees
half a record; every metrics record and sample also goes to the job's trackers.
With a run root (DOCKYARD_COORDINATOR_RUN_ROOT), `confine` keeps every job's
run folder, checkpoints and local MLflow store inside it, symlinks resolved, or
refuses the job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

from dockyard.config import MasterConfig
from dockyard.monitoring.trackers import Trackers
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
    uri = config.logger.mlflow.tracking_uri
    if uri is not None and (uri.startswith("file:") or "://" not in uri):
        # A local MLflow store is a folder the coordinator writes: it stays inside the root too.
        folder = inside("logger.mlflow.tracking_uri", unquote(urlparse(uri).path) if uri.startswith("file:") else uri)
        mlflow = config.logger.mlflow.model_copy(update={"tracking_uri": Path(folder).as_uri()})
        logger = logger.model_copy(update={"mlflow": mlflow})
    update = {"logger": logger}
    if config.checkpointing.checkpoint_dir is not None:
        checkpoint_dir = inside("checkpointing.checkpoint_dir", config.checkpointing.checkpoint_dir)
        update["checkpointing"] = config.checkpointing.model_copy(update={"checkpoint_dir": checkpoint_dir})
    return config.model_copy(update=update)


# curves.png: (panel title, [(legend label, record kind, metric), ...]); a panel no record fills is left out.
PANELS = (
    ("train reward", [("mean", "train", "reward_mean")]),
    ("validation pass rate", [("pass rate", "validation", "pass_rate")]),
    ("loss", [("loss", "train", "loss"), ("policy gradient", "train", "pg_loss")]),
    ("KL", [("to reference", "train", "kl"), ("generation vs training", "train", "gen_train_kl")]),
    ("entropy", [("entropy (nats/token)", "train", "entropy")]),
    ("clip fraction", [("clip", "train", "clip_fraction"), ("dual clip", "train", "dual_clip_fraction")]),
    ("staleness (steps)", [("mean age", "train", "staleness_mean"), ("max age", "train", "staleness_max")]),
    (
        "tokens/s",
        [("generated", "train", "generated_tokens_per_second"), ("trained", "train", "tokens_per_second")],
    ),
)
# A sample's prompt or completion beyond this many characters is cut (samples.jsonl stays readable).
MAX_SAMPLE_CHARS = 4000


class RunFolder:
    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.metrics_path = path / "metrics.jsonl"
        self.trackers = trackers

    def write_config(self, resolved_yaml: str) -> None:
        (self.path / "config.yaml").write_text(resolved_yaml)

    def append(self, kind: str, step: int, values: dict[str, float | int | str]) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(kind, step, values)

    def record_group(self, group_id: str, outcome: str, weight_version: int, error: str = "") -> None:
        """One line of groups.jsonl; a failed group's line carries its first failure (`error`)."""
        record = {"group_id": group_id, "outcome": outcome, "weight_version": weight_version, "time": time.time()}
        if error:
            record["error"] = error
        with (self.path / "groups.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def record_samples(self, step: int, samples: list[dict]) -> None:
        """A step's sample completions (group_id, prompt, completion, reward, verdict each)."""
        if not samples:
            return
        rows = [
            {
                "step": step,
                **sample,
                "prompt": sample["prompt"][:MAX_SAMPLE_CHARS],
                "completion": sample["completion"][:MAX_SAMPLE_CHARS],
            }
            for sample in samples
        ]
        with (self.path / "samples.jsonl").open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        if self.trackers is not None:
            self.trackers.samples(step, rows)

    def record_trials(self, step: int, trials: list[dict]) -> None:
        """Passing agent trials, whole (their conversations are what `dockyard export-sft` exports)."""
        if trials:
            with (self.path / "trials.jsonl").open("a") as f:
                f.write("".join(json.dumps({"step": step, **trial}) + "\n" for trial in trials))

    def records(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def plot(self) -> list[str]:
        """curves.png with one panel per metric family the records hold; the titles drawn, in order."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        records = self.records()
        panels = []
        for title, lines in PANELS:
            drawn = []
            for label, kind, key in lines:
                points = [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r]
                if points:
                    drawn.append((label, points))
            if drawn:
                panels.append((title, drawn))
        if not panels:
            return []
        columns = 2
        rows = (len(panels) + columns - 1) // columns
        # The Figure API, not pyplot: each call owns its figure, so jobs may plot from threads at once.
        fig = Figure(figsize=(11, 2.6 * rows), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(rows, columns, squeeze=False).flatten()
        for ax, (title, drawn) in zip(axes, panels, strict=False):
            for label, points in drawn:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, "o-" if len(points) < 20 else "-", markersize=3, label=label)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(f"job {self.path.name}", fontsize=11)
        fig.savefig(self.path / "curves.png", dpi=90)
        return [title for title, _ in panels]
