"""Question-answering tasks in the style of Humanity's Last Exam, scored by a grading program in the sandbox.

    JSONL row (id, question, answer, answer_type, choices?, rationale?)
      ──task_of──> Task(prompt = question [+ lettered choices] + the response format,
                        tests = ("assert grade(RESPONSE, answer, answer_type)",),
                        solution = "Explanation: <rationale>\\nAnswer: <answer>")
    completion ──program_for──> qa_grading's own source + RESPONSE = <the completion, as a literal>
               ──RunTests(program, tests)──> PASSED iff the final "Answer:" line matches (qa_grading.py's rules)

Guarantees: `answer_type` is HLE's ("exactMatch" or "multipleChoice"); a multiple-choice row's answer is
one letter, within its `choices` when those are given; a bad row is a ValueError naming the file, the line
and the field; the completion reaches the program only as a string literal (repr), never as code;
`load_tasks` is deterministic for (path, n, seed) and cycles through seeded permutations.
"""

from __future__ import annotations

import string
from importlib import resources
from pathlib import Path

from dockyard.tasks.jsonl import read_records
from dockyard.tasks.task import Task, draw

FIELDS = ("id", "question", "answer", "answer_type")
ANSWER_TYPES = ("exactMatch", "multipleChoice")
# HLE's response format, without its confidence line (nothing here reads a confidence).
RESPONSE_FORMAT = (
    "Your response should be in the following format:\n"
    "Explanation: {your explanation for your final answer}\n"
    "Answer: {your final answer}"
)


def _text(item: dict, field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def task_of(item: dict, where: str) -> Task:
    """The task of one row; ValueError naming `where` (file:line) and the field at fault."""
    task_id, question, answer = (_text(item, f, where) for f in ("id", "question", "answer"))
    answer_type = item["answer_type"]
    if answer_type not in ANSWER_TYPES:
        raise ValueError(f"{where}: answer_type {answer_type!r} must be one of {', '.join(ANSWER_TYPES)}")
    choices = item.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, str) and c.strip() for c in choices):
        raise ValueError(f"{where}: choices must be a list of non-empty strings")
    if len(choices) > 26:
        raise ValueError(f"{where}: choices holds {len(choices)} options; at most 26 (A-Z)")
    if answer_type == "multipleChoice":
        letters = string.ascii_uppercase[: len(choices)] if choices else string.ascii_uppercase
        if answer.strip().upper() not in letters or len(answer.strip()) != 1:
            raise ValueError(
                f"{where}: a multipleChoice answer is one letter of {letters[0]}-{letters[-1]}, got {answer!r}"
            )
    rationale = item.get("rationale") or ""
    if not isinstance(rationale, str):
        raise ValueError(f"{where}: rationale must be a string")
    prompt = question.strip()
    if choices:
        prompt += "\nAnswer Choices:" + "".join(
            f"\n{letter}. {c}" for letter, c in zip(string.ascii_uppercase, choices, strict=False)
        )
    prompt += f"\n\n{RESPONSE_FORMAT}\n"
    return Task(
        task_id=task_id,
        prompt=prompt,
        tests=(f"assert grade(RESPONSE, {answer!r}, {answer_type!r}), 'the final answer is not {answer_type}'",),
        solution=f"Explanation: {rationale.strip() or 'see above'}\nAnswer: {answer}",
        answer=answer,
    )


def load_rows(path: str | Path) -> list[Task]:
    """Every task of a JSONL (optionally gzipped) file of rows; ValueError naming the file and line."""
    raw = Path(path).read_bytes()
    tasks = [task_of(item, f"{path}:{number}") for number, item in read_records(raw, str(path), FIELDS)]
    if not tasks:
        raise ValueError(f"{path} holds no question (one JSON object per line with {', '.join(FIELDS)})")
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise ValueError(f"{path}: id {task.task_id!r} appears twice; ids name tasks in logs and groups")
        seen.add(task.task_id)
    return tasks


def load_tasks(path: str | Path, n: int, seed: int = 0) -> list[Task]:
    """n tasks of the file at `path` (seeded permutations, cycling when n exceeds the file)."""
    return draw(load_rows(path), n, f"qa:{Path(path).name}:{seed}")


def grading_source() -> str:
    return (resources.files("dockyard.tasks") / "qa_grading.py").read_text(encoding="utf-8")


def program_for(completion: str) -> str:
    """The program RunTests executes: the grading rules, then the completion as a string literal."""
    return f"{grading_source()}\n\nRESPONSE = {completion!r}\n"
