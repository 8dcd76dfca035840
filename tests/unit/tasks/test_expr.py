"""Expression tasks: deterministic, disjoint splits, self-consistent tests."""

from __future__ import annotations

import pytest

from dockyard.tasks.expr import (
    FAMILIES,
    HELD_OUT_INPUTS,
    SHOWN_INPUTS,
    make_tasks,
    pool_size,
    program_for,
)
from dockyard.tasks.task import Task


def _passes(completion: str, task: Task) -> list[bool]:
    namespace: dict = {}
    exec(program_for(completion), namespace)
    results = []
    for test in task.tests:
        try:
            exec(test, namespace)
            results.append(True)
        except AssertionError:
            results.append(False)
    return results


def test_make_tasks_is_deterministic_and_seed_dependent():
    assert make_tasks("train", 50, seed=3) == make_tasks("train", 50, seed=3)
    assert make_tasks("train", 50, seed=3) != make_tasks("train", 50, seed=4)


def test_splits_are_disjoint_by_function():
    train = make_tasks("train", pool_size("train"))
    validation = make_tasks("validation", pool_size("validation"))
    train_tests = {t.tests for t in train}
    validation_tests = {t.tests for t in validation}
    # One full pass over each pool yields every function exactly once.
    assert len(train_tests) == len(train) and len(validation_tests) == len(validation)
    assert not train_tests & validation_tests
    assert not {t.prompt for t in train} & {t.prompt for t in validation}
    assert not {t.solution for t in train} & {t.solution for t in validation}
    assert len(validation) >= 64 and len(train) > 2 * len(validation)


def test_n_beyond_pool_repeats_functions_with_distinct_ids():
    n = pool_size("validation") + 5
    tasks = make_tasks("validation", n, seed=1)
    assert len(tasks) == n
    assert len({t.task_id for t in tasks}) == n
    assert len({t.tests for t in tasks}) == pool_size("validation")


def test_bad_split_and_n_are_rejected():
    with pytest.raises(ValueError):
        make_tasks("test", 1)
    with pytest.raises(ValueError):
        make_tasks("train", -1)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_reference_solutions_pass_all_their_tests(split):
    for task in make_tasks(split, pool_size(split)):
        assert all(_passes(task.solution, task)), task
        assert "\n" not in task.solution


def test_prompt_shows_examples_and_tests_hold_out_points():
    task = make_tasks("train", 1, seed=0)[0]
    assert task.prompt.endswith("\nf(x)=")
    assert len(task.tests) == len(SHOWN_INPUTS) + len(HELD_OUT_INPUTS)
    for x in SHOWN_INPUTS:
        assert f"f({x})=" in task.prompt
    for x in HELD_OUT_INPUTS:
        assert f"f({x})=" not in task.prompt
        assert any(t.startswith(f"assert f({x}) ==") for t in task.tests)


def test_wrong_completion_gets_partial_credit_only():
    task = next(t for t in make_tasks("train", 200) if t.solution.startswith("x+"))
    # x*x+b agrees with x+b exactly at x in {0, 1}.
    wrong = task.solution.replace("x+", "x*x+", 1)
    results = _passes(wrong, task)
    assert 0 < sum(results) < len(results)


def test_program_for_uses_only_the_first_line():
    assert program_for("2*x+1\nprint('junk')") == "def f(x):\n    return 2*x+1\n"
    namespace: dict = {}
    exec(program_for("x%3 \n"), namespace)
    assert namespace["f"](7) == 1


def test_families_narrow_the_pool_keeping_each_functions_split_and_reference():
    for split in ("train", "validation"):
        whole = {t.solution: t.tests for t in make_tasks(split, pool_size(split))}
        sizes = []
        for family in FAMILIES:
            tasks = make_tasks(split, pool_size(split, [family]), families=[family])
            assert {t.task_id.rsplit("-", 1)[1] for t in tasks} == {family}
            assert all(whole[t.solution] == t.tests for t in tasks)  # the same function, tests and split
            assert len({t.solution for t in tasks}) == len(tasks)
            sizes.append(len(tasks))
        assert sum(sizes) == pool_size(split)
        assert make_tasks(split, 5, 3, ["x+b", "x*x+b"]) == make_tasks(split, 5, 3, ["x+b", "x*x+b"])
    with pytest.raises(ValueError, match="unknown function families"):
        make_tasks("train", 1, families=["x**3"])
