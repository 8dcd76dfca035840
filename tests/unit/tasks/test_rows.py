"""Rows from files and folders: JSON Lines (gzipped too), Parquet, datasets folders, with locators."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from dockyard.tasks.rows import read_rows

ROWS = [{"prompt": "p0", "tests": ["assert 1"]}, {"prompt": "p1", "tests": ["assert 2"]}, {"prompt": "p2", "tests": []}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_are_named_by_file_and_line_and_blank_lines_keep_numbering(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    assert read_rows(path) == [(f"{path}:1", ROWS[0]), (f"{path}:3", ROWS[1])]


def test_gzipped_jsonl_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    assert [row for _, row in read_rows(path)] == ROWS


def test_parquet_rows_are_named_by_row_index(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), path)
    rows = read_rows(path)
    assert [loc for loc, _ in rows] == [f"{path}:row 0", f"{path}:row 1", f"{path}:row 2"]
    assert [row["prompt"] for _, row in rows] == ["p0", "p1", "p2"]
    assert rows[0][1]["tests"] == ["assert 1"]


def test_a_saved_dataset_folder_and_a_saved_dataset_dict_pick_the_split(tmp_path: Path) -> None:
    flat = [{"prompt": r["prompt"], "tests": json.dumps(r["tests"])} for r in ROWS]
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "one"))
    assert [row["prompt"] for _, row in read_rows(tmp_path / "one", "validation")] == ["p0", "p1", "p2"]
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(flat[:2]), validation=datasets.Dataset.from_list(flat[2:])
    )
    both.save_to_disk(str(tmp_path / "both"))
    val = read_rows(tmp_path / "both", "validation")
    assert val == [(f"{tmp_path / 'both'}[validation]:row 0", flat[2])]
    assert len(read_rows(tmp_path / "both", "train")) == 2
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'validation'\] and none is named 'test'"):
        read_rows(tmp_path / "both", "test")


def test_a_folder_of_data_files_splits_by_file_name(tmp_path: Path) -> None:
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    write_jsonl(folder / "data" / "train-00000.jsonl", ROWS[:2])
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS[2:]), folder / "data" / "validation-00000.parquet")
    (folder / "README.md").write_text("# a dataset card, not data\n")
    assert [row["prompt"] for _, row in read_rows(folder, "train")] == ["p0", "p1"]
    [(locator, row)] = read_rows(folder, "validation")
    assert locator == f"{folder / 'data' / 'validation-00000.parquet'}:row 0" and row["prompt"] == "p2"
    unsplit = tmp_path / "plain"
    unsplit.mkdir()
    write_jsonl(unsplit / "a.jsonl", ROWS[:1])
    write_jsonl(unsplit / "b.jsonl", ROWS[1:])
    assert [row["prompt"] for _, row in read_rows(unsplit, "validation")] == ["p0", "p1", "p2"]


def test_unreadable_input_names_the_file_and_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        read_rows(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"^{bad}:2: not JSON"):
        read_rows(bad)
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="d.csv: unknown file type"):
        read_rows(csv)
    broken = tmp_path / "d.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="d.parquet: not a readable Parquet file"):
        read_rows(broken)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: holds no data file"):
        read_rows(tmp_path / "empty")
