"""Program-synthesis tasks from your own datasets: rows of a prompt (or chat messages) plus tests.

    data.<split>: path + fields, sources[i].path + fields ──rows.read_rows──> (locator, row)
        ──task_of_row(fields)──> Task(prompt | messages, tests, answer, metadata)
        ──split (see below), draw(size, seed)──> tasks
    completion ──program_for(task)──> the program RunTests runs against task.tests

A row is read with its source's field mapping (`fields`, FieldsConfig): `prompt` (text) or
`messages` ([{role, content}], rendered through the policy's chat template), `tests` (a string is
one test of Python source; a list holds one statement each, typically asserts), and optionally
`id`, `answer`, `solution` and the `metadata` columns. A row in HumanEval's shape (no tests column,
and `entry_point` or `test`; the format needs `task_id`, `prompt`, `entry_point` and `test`) keeps
HumanEval's meaning: its test is `test` + `check(entry_point)` and the program is the prompt
completed by the policy. Any other program is the completion's code: its first fenced code block,
else the whole completion.

Splits: a split's files are its `path` and `sources`; a split with none takes the other split's.
A file that serves both splits is split by a hash of the task id (about one task in four goes
to validation); a file that serves one split is taken whole. HumanEval's bundled problems serve
both splits (hash split) for `program_bench` always, and for `program_synthesis` when neither
split names a file.

Guarantees: a row without what its mapping needs (or with a value of the wrong type) is a
ValueError naming the file, the line or row, the field and the column it was mapped to; loading
is deterministic for the config; nothing is written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from dockyard.config import DatasetConfig, FieldsConfig
from dockyard.tasks import humaneval
from dockyard.tasks.rows import read_rows
from dockyard.tasks.task import Task, draw

# The first fenced block of a completion, whatever its language tag.
_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


def code_of(completion: str) -> str:
    """The program in a completion: its first fenced code block, else the whole completion."""
    fenced = _FENCE.search(completion)
    return (fenced.group(1) if fenced else completion).rstrip() + "\n"


def program_for(task: Task, completion: str) -> str:
    """The program RunTests runs for `completion` of `task`."""
    if task.completes_prompt:
        return humaneval.program_for(task.prompt, completion)
    return code_of(completion)


def _column(fields: FieldsConfig, name: str) -> tuple[str, bool]:
    """The column `name` is mapped to, and whether it is required: mapped to a column other than its default
    (a resolved config names every default, so what was written cannot tell)."""
    column = getattr(fields, name)
    return column, column != FieldsConfig.model_fields[name].default


def _text(locator: str, row: Mapping[str, Any], field: str, column: str) -> str:
    value = row[column]
    if not isinstance(value, str):
        raise ValueError(f"{locator}: field {field} (column {column!r}) is {type(value).__name__}, not a string")
    return value


def _messages(locator: str, value: Any, column: str) -> tuple[tuple[str, str], ...]:
    shape = f"{locator}: field messages (column {column!r}) is a non-empty list of {{role, content}} strings"
    if not isinstance(value, list) or not value:
        raise ValueError(shape)
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{shape}; message {i} is not")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{shape}; message {i} has no string content")
        out.append((message["role"], message["content"]))
    return tuple(out)


def _tests(locator: str, value: Any, column: str) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        return (value,)
    if isinstance(value, list) and value and all(isinstance(t, str) and t.strip() for t in value):
        return tuple(value)
    raise ValueError(
        f"{locator}: field tests (column {column!r}) is Python test source or a non-empty list of test statements"
    )


def task_of_row(locator: str, row: Mapping[str, Any], fields: FieldsConfig) -> Task:
    """One row as a task (see the module docstring); ValueError naming the locator and the field."""
    tests_column, _ = _column(fields, "tests")
    if row.get(tests_column) is None and {"entry_point", "test"} & row.keys():
        return _humaneval_row(locator, row, fields)
    if row.get(tests_column) is None:
        raise ValueError(
            f"{locator}: missing field tests (column {tests_column!r}; set data.<split>.fields.tests to the "
            f"column that holds them; the row has {sorted(row)})"
        )
    tests = _tests(locator, row[tests_column], tests_column)
    prompt_column, messages_column = fields.prompt, fields.messages
    messages: tuple[tuple[str, str], ...] = ()
    if row.get(messages_column) is not None:
        messages = _messages(locator, row[messages_column], messages_column)
        users = [content for role, content in messages if role == "user"]
        prompt = users[-1] if users else messages[-1][1]
    elif row.get(prompt_column) is not None:
        prompt = _text(locator, row, "prompt", prompt_column)
    else:
        raise ValueError(
            f"{locator}: missing field prompt (column {prompt_column!r}) or messages (column {messages_column!r}); "
            f"the row has {sorted(row)}"
        )
    _check_required(locator, row, fields)
    id_column = fields.id
    task_id = str(row[id_column]) if row.get(id_column) is not None else locator.rsplit("/", 1)[-1]
    solution = _text(locator, row, "solution", fields.solution) if row.get(fields.solution) is not None else ""
    return Task(
        task_id=task_id,
        prompt=prompt,
        tests=tests,
        solution=solution,
        messages=messages,
        answer=row.get(fields.answer),
        metadata={column: row[column] for column in fields.metadata},
    )


def _check_required(locator: str, row: Mapping[str, Any], fields: FieldsConfig) -> None:
    """Columns mapped away from their defaults, and the metadata columns, must be in the row."""
    named = [(name, *_column(fields, name)) for name in ("id", "answer", "solution")]
    for field, column, required in [*named, *(("metadata", c, True) for c in fields.metadata)]:
        if required and column not in row:
            raise ValueError(f"{locator}: missing field {field} (column {column!r}; see data.<split>.fields)")


def _humaneval_row(locator: str, row: Mapping[str, Any], fields: FieldsConfig) -> Task:
    for column in humaneval.FIELDS:
        if column not in row:
            raise ValueError(f"{locator}: missing field {column!r} (HumanEval's format needs {humaneval.FIELDS})")
        _text(locator, row, column, column)
    problem = humaneval.Problem(
        task_id=row["task_id"],
        prompt=row["prompt"],
        entry_point=row["entry_point"],
        canonical_solution=row.get("canonical_solution") or "",
        test=row["test"],
    )
    _check_required(locator, row, fields)
    metadata = {column: row[column] for column in fields.metadata}
    return replace(humaneval.task_of(problem), answer=row.get(fields.answer), metadata=metadata)


def _files(dataset: DatasetConfig) -> list[tuple[str, FieldsConfig]]:
    own = [(dataset.path, dataset.fields)] if dataset.path else []
    return own + [(s.path, s.fields) for s in dataset.sources]


def _key(path: str) -> str:
    return str(Path(path).resolve())


def load_tasks(split: str, dataset: DatasetConfig, other: DatasetConfig | None, *, bench: bool) -> list[Task]:
    """`dataset.size` tasks of `split` (see the module docstring); `other` is the other split's config."""
    own, theirs = _files(dataset), _files(other) if other is not None else []
    files = own or theirs
    shared = {_key(p) for p, _ in (theirs or own)}
    if not files and not bench:
        return humaneval.make_tasks(split, dataset.size, dataset.seed)  # program_synthesis as it always was
    pool = _humaneval_split(split) if bench else []
    for path, fields in files:
        tasks = [task_of_row(locator, row, fields) for locator, row in read_rows(path, split)]
        if not tasks:
            raise ValueError(f"{path} holds no row")
        if _key(path) in shared:
            tasks = [t for t in tasks if humaneval.split_of(t.task_id) == split]
            if not tasks:
                raise ValueError(
                    f"no problem of {path} falls in the {split} split (it serves both splits, split by a hash of the "
                    "task id): give data.validation.path a file of its own, or add rows"
                )
        pool += tasks
    return draw(pool, dataset.size, f"programs:{split}:{dataset.seed}")


def _humaneval_split(split: str) -> list[Task]:
    return [humaneval.task_of(p) for p in humaneval.load_problems() if humaneval.split_of(p.task_id) == split]
