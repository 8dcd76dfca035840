"""Agent expression tasks: hidden points, f.py reports every point read, the splits of make_tasks."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dockyard.models.tokenizer import CHARSET, build_char_tokenizer
from dockyard.tasks.expr import (
    AGENT_TOOLS,
    TEST_INPUTS,
    agent_answer,
    f_output,
    make_agent_tasks,
    make_tasks,
    pool_size,
)
from tests.conftest import missing


def _python3() -> str:
    path = shutil.which("python3")
    if path is None:
        missing("python3 is not on PATH (the agent's tool f runs `python3 f.py <x>`)")
    return path


def _run_f(tmp_path, task, *args: str) -> subprocess.CompletedProcess:
    (path, content), *rest = task.files
    assert path == "f.py" and not rest
    if not (tmp_path / path).exists():
        (tmp_path / path).write_text(content)
    return subprocess.run(
        [_python3(), path, *args], cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False
    )


def test_f_py_prints_every_point_read_so_far(tmp_path):
    tasks = make_agent_tasks("validation", 4, seed=0)
    assert {"x*x" in t.solution for t in tasks} == {True, False}
    for task in tasks:
        values = {}
        exec(f"def f(x):\n    return {task.solution}\n", values)
        folder = tmp_path / task.task_id
        folder.mkdir()
        read = []
        for x in (5, -3, 0, 5, *TEST_INPUTS):
            done = _run_f(folder, task, str(x))
            read.append(x)
            assert done.returncode == 0, done.stderr
            # Sorted, each point once: the session's points.txt carries them from call to call.
            expected = " ".join(f"f({k})={values['f'](k)}" for k in sorted(set(read)))
            assert done.stdout.strip() == expected == f_output(task.solution, read)
        # The tests score the reference: f(x) at every test input is what f.py prints there.
        assert [f"assert f({x}) == {values['f'](x)}" for x in TEST_INPUTS] == list(task.tests)


@pytest.mark.parametrize("args", [("1.5",), ("x",), ("",), ()])
def test_f_py_refuses_what_is_not_one_integer(tmp_path, args):
    done = _run_f(tmp_path, make_agent_tasks("train", 1)[0], *args)
    assert done.returncode == 1
    assert done.stdout == "" and "integer" in done.stderr and len(done.stderr.splitlines()) == 1


def test_prompt_shows_no_point_and_is_one_token_per_character():
    tok = build_char_tokenizer()
    for task in make_agent_tasks("train", 50) + make_agent_tasks("validation", 20):
        assert not any(ch.isdigit() for ch in task.prompt)
        assert set(task.prompt) <= set(CHARSET)
        assert len(tok(task.prompt, add_special_tokens=False)["input_ids"]) == len(task.prompt)


def test_same_functions_tests_and_solutions_as_make_tasks():
    for split, n, seed in (("train", 40, 0), ("validation", 30, 5)):
        agent, single = make_agent_tasks(split, n, seed), make_tasks(split, n, seed)
        assert [(t.tests, t.solution) for t in agent] == [(t.tests, t.solution) for t in single]
        assert len({t.task_id for t in agent}) == n
        assert not {t.task_id for t in agent} & {t.task_id for t in single}
    assert make_agent_tasks("train", 20, seed=3) == make_agent_tasks("train", 20, seed=3)


def test_splits_are_disjoint_by_function():
    train = make_agent_tasks("train", pool_size("train"))
    validation = make_agent_tasks("validation", pool_size("validation"))
    for attr in ("tests", "solution", "files"):
        train_values = {getattr(t, attr) for t in train}
        validation_values = {getattr(t, attr) for t in validation}
        assert len(train_values) == len(train) and len(validation_values) == len(validation)
        assert not train_values & validation_values


def test_the_agent_tool_is_f_of_one_integer():
    shapes = {t["function"]["name"]: t["function"]["parameters"] for t in AGENT_TOOLS}
    assert shapes == {"f": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


def test_an_answer_is_scored_with_or_without_its_f_of_x_prefix():
    assert agent_answer("f(x)=2*x+1") == agent_answer(" 2*x+1\nmore") == "2*x+1"
    assert agent_answer("f(x)= x*x") == "x*x" and agent_answer("") == ""
