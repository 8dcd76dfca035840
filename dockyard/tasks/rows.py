"""Rows of a dataset file or folder, each with a locator that names where it came from.

    file.jsonl / file.jsonl.gz / file.json (JSON Lines) ──> ("file.jsonl:7", {...})      line numbers from 1
    file.parquet                                        ──> ("file.parquet:row 3", {...}) rows from 0
    folder saved by datasets' save_to_disk              ──> ("folder:row 3", {...})       datasets.load_from_disk
    folder of data files (.jsonl(.gz), .json, .parquet) ──> each file's rows, files sorted, split by the Hugging
                                                            Face naming conventions (train-*, data/validation*, ...)

Guarantees: every row is a dict of Python values (str, int, float, list, dict, None); a locator is
`<path>:<line>` for JSON Lines and `<path>:row <index>` for columnar data, where the index is the
row's position as `dataset[index]` or pandas' `iloc` reads it. A folder holding several splits
(a DatasetDict, or files named by split) gives the rows of `split`; a folder holding one split
gives its rows whatever its name. Anything unreadable is a ValueError or FileNotFoundError that
names the file (and line) and what is wrong, in the style of dockyard/tasks/jsonl.py; nothing is
written (no cache: the `datasets` library is used only to read saved folders and to resolve split
file names). Field checks belong to the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dockyard.tasks.jsonl import read_records

Row = tuple[str, dict[str, Any]]
JSON_LINES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PARQUET = (".parquet",)
FORMATS = "JSON Lines (.jsonl, .jsonl.gz), Parquet (.parquet), a datasets save_to_disk folder or a folder of such files"


def read_rows(path: str | Path, split: str = "train") -> list[Row]:
    """The rows of a file or folder (see the module docstring), in file order."""
    source = Path(path)
    if source.is_dir():
        return _folder_rows(source, split)
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist (a dataset is {FORMATS})")
    return _file_rows(source)


def _file_rows(file: Path) -> list[Row]:
    name = file.name.lower()
    if name.endswith(JSON_LINES):
        return [(f"{file}:{line}", item) for line, item in read_records(file.read_bytes(), str(file), ())]
    if name.endswith(PARQUET):
        import pyarrow
        import pyarrow.parquet

        try:
            table = pyarrow.parquet.read_table(file)
        except (pyarrow.ArrowException, OSError) as exc:
            raise ValueError(f"{file}: not a readable Parquet file ({exc})") from None
        return [(f"{file}:row {i}", row) for i, row in enumerate(table.to_pylist())]
    raise ValueError(f"{file}: unknown file type; a dataset is {FORMATS}")


def _folder_rows(folder: Path, split: str) -> list[Row]:
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return _saved_rows(folder, split)
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(folder)), str(folder))
    except EmptyDatasetError:
        raise ValueError(f"{folder}: holds no data file ({FORMATS})") from None
    chosen = _pick_split(folder, {str(name): list(paths) for name, paths in files.items()}, split)
    return [row for file in sorted(chosen) for row in _file_rows(Path(file))]


def _saved_rows(folder: Path, split: str) -> list[Row]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder}: not a readable save_to_disk folder ({exc})") from None
    where = str(folder)
    if isinstance(saved, datasets.DatasetDict):
        name = _pick_split(folder, {str(k): k for k in saved}, split)
        saved, where = saved[name], f"{folder}[{name}]" if len(saved) > 1 else where
    return [(f"{where}:row {i}", row) for i, row in enumerate(saved)]


def _pick_split(folder: Path, splits: dict[str, Any], split: str) -> Any:
    """The one split there is, or the one named `split`."""
    if len(splits) == 1:
        return next(iter(splits.values()))
    if split in splits:
        return splits[split]
    raise ValueError(
        f"{folder}: holds the splits {sorted(splits)} and none is named {split!r}; point the path at one split's "
        "file, or name the files by split (train-*, validation-*)"
    )
