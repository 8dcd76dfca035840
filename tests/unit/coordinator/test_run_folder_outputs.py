"""The run folder's curves.png panels, samples.jsonl, and the sample reservoir behind it."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from dockyard.api.common.v1 import common_pb2
from services.coordinator.run_folder import RunFolder
from services.coordinator.samples import SampleReservoir


def test_curves_png_draws_one_panel_per_metric_family_the_run_reports(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "job")
    folder.append("validation", 0, {"pass_rate": 0.2})
    for step in range(1, 6):
        folder.append(
            "train",
            step,
            {"reward_mean": 0.1 * step, "loss": 1.0 / step, "kl": 0.01, "entropy": 0.8, "staleness_mean": 0.5},
        )
    folder.append("validation", 5, {"pass_rate": 0.6})
    titles = folder.plot()
    # No clip fraction or tokens/s in these records: their panels are left out.
    assert titles == ["train reward", "validation pass rate", "loss", "KL", "entropy", "staleness (steps)"]
    with Image.open(tmp_path / "job" / "curves.png") as image:
        assert image.size == (11 * 90, round(3 * 2.6 * 90))  # two columns, three rows of panels


def test_an_empty_run_draws_nothing(tmp_path: Path) -> None:
    assert RunFolder(tmp_path / "job").plot() == []
    assert not (tmp_path / "job" / "curves.png").exists()


def group(group_id: str, n: int) -> common_pb2.Group:
    return common_pb2.Group(
        group_id=group_id,
        prompt=f"prompt of {group_id}",
        trajectories=[
            common_pb2.Trajectory(
                completion_text=f"{group_id}/{i}",
                reward=float(i % 2),
                verdict=common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED),
            )
            for i in range(n)
        ],
    )


def test_the_reservoir_keeps_k_rows_a_step_drawn_from_every_group() -> None:
    reservoir = SampleReservoir(3, seed=0)
    seen = set()
    for _ in range(200):
        for g in range(5):
            reservoir.offer(group(f"g{g}", 4))
        rows = reservoir.take()
        assert len(rows) == 3
        seen.update(r["group_id"] for r in rows)
    assert seen == {f"g{g}" for g in range(5)}  # not only the last groups of a step
    assert rows[0].keys() == {"group_id", "prompt", "completion", "reward", "verdict"}
    assert rows[0]["verdict"] == "passed" and rows[0]["prompt"] == f"prompt of {rows[0]['group_id']}"
    assert SampleReservoir(0, seed=0).take() == []


def test_samples_jsonl_gets_one_line_per_sample_with_its_step(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "job")
    reservoir = SampleReservoir(2, seed=1)
    reservoir.offer(group("g0", 3))
    folder.record_samples(7, reservoir.take())
    lines = [json.loads(line) for line in (tmp_path / "job" / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [7, 7]
    assert all(line["completion"].startswith("g0/") and line["prompt"] == "prompt of g0" for line in lines)
