"""Each tracker backend, in process, for a few steps; what it wrote is read back with its own library."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import time
from pathlib import Path

import pytest

from dockyard.config import LoggerConfig
from dockyard.monitoring.series import split_series, summarise
from dockyard.monitoring.trackers import Trackers, missing_libraries
from tests.conftest import missing

STEPS = 3
SAMPLE = {"step": 2, "group_id": "g/7", "prompt": "f(1)=2", "completion": "x+1", "reward": 1.0, "verdict": "passed"}


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        missing(f"{module} is not installed: pip install -e '.[trackers]'")


def write_run(tmp_path: Path, **flags: bool) -> Path:
    """Three train steps (two replicas' Generate calls each), a validation, the buffer's counts, samples."""
    logger = LoggerConfig(**flags, log_dir=str(tmp_path))
    run_dir = tmp_path / "job-1"
    trackers = Trackers(logger, run_dir, "job-1", {"grpo": {"max_num_steps": STEPS}})
    trackers.log("validation", 0, {"pass_rate": 0.25, "num_tasks": 8.0})
    for step in range(1, STEPS + 1):
        for i, replica in enumerate(("r0", "r1", "r0")):
            call = {"replica": replica, "group_id": f"g{i}", "start": 0.0, "end": 2.0, "tokens": 10 * step + i}
            trackers.log("generation", step, call)
        trackers.log(
            "train",
            step,
            {"loss": 1.0 / step, "replica_r0_tokens_per_second": 5.0, "replica_r1_tokens_per_second": 7.0},
        )
        if step == 2:
            trackers.samples(2, [SAMPLE])
    trackers.log("buffer", STEPS, {"buffer_acked": 12.0})
    trackers.close()
    return run_dir


def test_lists_merge_across_replicas_into_one_bounded_set_of_keys() -> None:
    scalars, series = split_series(
        {"loss": 0.5, "replica_a_tokens_per_second": 4.0, "replica_b_1_tokens_per_second": 8.0, "sandbox_w_queued": 2},
        [{"start": 0.0, "end": 2.0, "tokens": 10}, {"start": 1.0, "end": 2.0, "tokens": 30}],
    )
    assert scalars == {"loss": 0.5}
    assert series["replica_tokens_per_second"] == [4.0, 8.0] and series["sandbox_queued"] == [2.0]
    assert series["generation_tokens_per_second"] == [5.0, 30.0]
    summary = summarise({"x": [1.0, 2.0, 3.0, 10.0]})
    assert summary == {"x/mean": 4.0, "x/p50": 2.5, "x/p90": pytest.approx(7.9), "x/max": 10.0}


def test_an_enabled_tracker_without_its_library_is_named_with_the_extra(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "swanlab" else real(name))
    assert missing_libraries(LoggerConfig(swanlab_enabled=True, tensorboard_enabled=True)) == [
        "logger.swanlab_enabled=true needs the swanlab library here: "
        "pip install -e '.[trackers]' in the dockyard clone"  # the project's extra, not a package index's "dockyard"
    ]


def test_tensorboard_event_files_hold_every_step(tmp_path: Path) -> None:
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = write_run(tmp_path, tensorboard_enabled=True)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [(e.step, round(e.value, 4)) for e in loss] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert [e.value for e in events.Scalars("train/replica_tokens_per_second/max")] == [7.0] * STEPS
    assert [e.value for e in events.Scalars("train/generation_tokens/max")] == [12.0, 22.0, 32.0]
    assert [(e.step, e.value) for e in events.Scalars("val/pass_rate")] == [(0, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("buffer/buffer_acked")] == [(STEPS, 12.0)]
    assert not any("r0" in tag or "r1" in tag for tag in events.Tags()["scalars"])


def test_mlflow_file_store_holds_metrics_and_the_samples_table(tmp_path: Path) -> None:
    need("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir = write_run(tmp_path, mlflow_enabled=True)
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("dockyard")
    [run] = client.search_runs([experiment.experiment_id], filter_string="tags.`dockyard.job_id` = 'job-1'")
    assert run.info.run_name == "job-1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 4)) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert run.data.metrics["train/generation_tokens/p50"] == 31.0
    assert run.data.metrics["val/pass_rate"] == 0.25
    table = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples/step_000002.json", tmp_path)).read_text()
    )
    assert table["columns"][:4] == ["step", "group_id", "prompt", "completion"] and table["data"][0][3] == "x+1"


def wandb_records(run_folder: Path) -> list:
    """The records of a W&B offline run file, once its exit record is written (wandb's service
    process may still be writing when finish() returns)."""
    deadline = time.monotonic() + 30
    while True:
        records = read_wandb_file(run_folder)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def read_wandb_file(run_folder: Path) -> list:
    """LevelDB's log format (32 KiB blocks of chunks with a 7-byte header after a 7-byte file
    header), each record one wandb protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(str(run_folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, pending, records = Path(path).read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_holds_scalars_histograms_and_the_samples_table(tmp_path: Path) -> None:
    need("wandb")
    run_dir = write_run(tmp_path, wandb_enabled=True)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(run_dir)
        if r.WhichOneof("record_type") == "history"
    ]
    train = [h for h in history if "train/loss" in h]
    assert [(h["_step"], round(h["train/loss"], 4)) for h in train] == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    # The full series: the three Generate calls of the step as a histogram, not a summary.
    assert [h["train/generation_tokens/_type"] for h in train] == ["histogram"] * STEPS
    assert [sum(h["train/generation_tokens/values"]) for h in train] == [3] * STEPS
    assert not any("train/generation_tokens/p50" in h for h in history)
    [samples] = [h for h in history if "samples/_type" in h]
    table = json.loads(next(run_dir.glob("wandb/offline-run-*/files/" + samples["samples/path"])).read_text())
    assert table["columns"] == ["step", "group_id", "prompt", "completion", "reward", "verdict"]
    assert table["data"] == [[2, "g/7", "f(1)=2", "x+1", 1.0, "passed"]]


def test_swanlab_offline_log_holds_scalars_and_sample_texts(tmp_path: Path) -> None:
    need("swanlab")
    from swanlab.log.backup.datastore import DataStore
    from swanlab.log.backup.models import ModelsParser

    run_dir = write_run(tmp_path, swanlab_enabled=True)
    [backup] = glob.glob(str(run_dir / "swanlog" / "run-*" / "backup.swanlab"))
    store = DataStore()
    store.open_for_scan(backup)
    with ModelsParser() as parser:
        for record in store:
            if record is not None:
                parser.parse_record(record)
    _, _, experiment, _, _, _, scalars, media, footer = parser.get_parsed()
    assert experiment.name == "job-1" and footer is not None and footer.success
    loss = [(s.step, round(s.metric["data"], 4)) for s in scalars if s.key == "train/loss"]
    assert loss == [(1, 1.0), (2, 0.5), (3, 0.3333)]
    assert [s.metric["data"] for s in scalars if s.key == "train/replica_tokens_per_second/mean"] == [6.0] * STEPS
    [texts] = [m for m in media if m.key == "samples"]
    assert texts.step == 2 and "x+1" in texts.metric["data"][0]
