"""Question answering (env hle): final-answer extraction, normalisation, choice letters, the row loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dockyard.tasks import qa
from dockyard.tasks.qa_grading import as_number, chosen_letter, exact_match, final_answer, grade, normalise
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "examples" / "tasks" / "qa"


def test_the_last_answer_line_is_the_final_answer():
    text = "Explanation: first I thought\nAnswer: 3\nwait, no.\n**Answer:** 4\nConfidence: 80%"
    assert final_answer(text) == "4"
    assert final_answer("answer: x") == "x"
    assert final_answer("The answer is 4.") is None
    assert not grade("The answer is 4.", "4", "exactMatch")  # no Answer: line, no credit


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("0.50", "1/2"),
        (".5", "1/2"),
        ("50%", "0.5"),
        ("1,000", "1000"),
        ("-4", "-4.0"),
        ("\\boxed{\\frac12}", "\\frac12"),
        ("$\\boxed{15}$", "15"),
        ("\\( 2/4 \\)", "0.5"),
        ("  TimSort. ", "Timsort"),
        ("\\text{Saint-Exupéry}", "saint exupéry"),
        ("“Hello, world!”", "hello world"),
        ("x^2 + 1", "X^2  +  1"),
    ],
)
def test_equal_answers_match(answer: str, reference: str):
    assert exact_match(answer, reference), (answer, reference, normalise(answer), normalise(reference))


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("0.333", "1/3"),  # no rounding tolerance
        ("15 primes", "15"),
        ("x^2 - 1", "x^2 + 1"),
        ("", "anything"),
        ("1/0", "1"),
        ("Timsort merge", "Timsort"),
    ],
)
def test_different_answers_do_not(answer: str, reference: str):
    assert not exact_match(answer, reference)


def test_numbers_read_exactly():
    assert as_number("1,234.5") is None  # separators only on integers
    assert as_number("1,234") == 1234 and as_number("3/4") == as_number("0.75") == as_number("75%")
    assert as_number("12abc") is None


@pytest.mark.parametrize(
    ("answer", "letter"),
    [("C", "C"), ("(c)", "C"), ("C)", "C"), ("C. tree", "C"), ("Option B", "B"), ("\\boxed{D}", "D"), ("[A]", "A")],
)
def test_the_chosen_letter_is_read_from_the_answer(answer: str, letter: str):
    assert chosen_letter(answer) == letter
    assert grade(f"Explanation: ...\nAnswer: {answer}", letter, "multipleChoice")


def test_no_letter_or_a_wrong_letter_fails():
    assert chosen_letter("tree") is None and chosen_letter("") is None
    assert not grade("Answer: B", "C", "multipleChoice")


def test_shipped_questions_load_and_their_solutions_pass_the_program_the_sandbox_runs():
    """The RunTests program run here in a bare interpreter: solutions pass, a wrong answer and an
    answer that tries to be code both fail."""
    for split in ("train", "validation"):
        tasks = qa.load_rows(SHIPPED / f"{split}.jsonl")
        assert len(tasks) >= 4 and len({t.task_id for t in tasks}) == len(tasks)
        for task in tasks:
            assert "Answer: {your final answer}" in task.prompt
            for completion, passes in ((task.solution, True), ("Answer: 12345", False), ("Answer: ' + '", False)):
                program = qa.program_for(completion) + task.tests[0] + "\n"
                run = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=30)
                assert (run.returncode == 0) is passes, (task.task_id, completion, run.stderr[-300:])


def test_choices_are_listed_with_letters():
    task = qa.task_of(
        {"id": "q", "question": "Pick one.", "answer": "B", "answer_type": "multipleChoice", "choices": ["x", "y"]},
        "f:1",
    )
    assert "Answer Choices:\nA. x\nB. y\n" in task.prompt


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"question": "q", "answer": "1", "answer_type": "exactMatch"}, ["f.jsonl:1", "missing field 'id'"]),
        ({"id": "a", "question": "q", "answer": "1", "answer_type": "exact"}, ["f.jsonl:1", "answer_type 'exact'"]),
        ({"id": "a", "question": "", "answer": "1", "answer_type": "exactMatch"}, ["f.jsonl:1", "'question'"]),
        (
            {"id": "a", "question": "q", "answer": "E", "answer_type": "multipleChoice", "choices": ["1", "2"]},
            ["f.jsonl:1", "one letter of A-B", "'E'"],
        ),
        ({"id": "a", "question": "q", "answer": "1", "answer_type": "exactMatch", "choices": "x"}, ["choices"]),
    ],
)
def test_a_bad_row_is_named(tmp_path: Path, row: dict, words: list[str]):
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as info:
        qa.load_rows(path)
    for word in words:
        assert word in str(info.value).replace(str(tmp_path) + "/", "")


def test_duplicate_ids_and_empty_files_are_refused(tmp_path: Path):
    row = json.dumps({"id": "a", "question": "q", "answer": "1", "answer_type": "exactMatch"})
    path = tmp_path / "f.jsonl"
    path.write_text(f"{row}\n{row}\n")
    with pytest.raises(ValueError, match="'a' appears twice"):
        qa.load_rows(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no question"):
        qa.load_rows(path)


def test_load_tasks_is_deterministic_and_cycles():
    path = SHIPPED / "train.jsonl"
    drawn = qa.load_tasks(path, 20, seed=3)
    assert drawn == qa.load_tasks(path, 20, seed=3) and len(drawn) == 20
    assert {t.task_id for t in drawn} == {t.task_id for t in qa.load_rows(path)}
