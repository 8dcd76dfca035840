"""env verifiers on the coordinator's side: rows as tasks, the runner's variables, its result as a verdict."""

from __future__ import annotations

import json

import pytest

from dockyard.agents import verifiers_runner
from dockyard.api.common.v1 import common_pb2
from dockyard.config.verifiers import RESULT_FILE, VerifiersConfig
from dockyard.tasks import verifiers_rows

CONFIG = VerifiersConfig(package="./env", module="my_env", args={"split": "train"}, eval_args={"split": "eval"})


def test_rows_are_a_seeded_order_of_every_index_and_name_their_split():
    tasks = verifiers_rows.make_tasks("train", 50, 3, "my_env")
    rows = [verifiers_rows.split_row(t.task_id) for t in tasks]
    assert sorted(r for _, r in rows) == list(range(50)) and {s for s, _ in rows} == {"train"}
    assert [r for _, r in rows] != list(range(50))  # shuffled
    assert tasks == verifiers_rows.make_tasks("train", 50, 3, "my_env")
    assert tasks != verifiers_rows.make_tasks("train", 50, 4, "my_env")
    assert verifiers_rows.split_row(verifiers_rows.make_tasks("validation", 1, 0, "m")[0].task_id) == ("validation", 0)


def test_the_runner_gets_the_row_and_the_splits_arguments():
    [train] = verifiers_rows.make_tasks("train", 1, 0, "my_env")
    [val] = verifiers_rows.make_tasks("validation", 1, 0, "my_env")
    env = verifiers_rows.runner_environment(CONFIG, train)
    assert json.loads(env["DOCKYARD_VERIFIERS_ENV"]) == {"module": "my_env", "args": {"split": "train"}, "row": 0}
    assert json.loads(verifiers_rows.runner_environment(CONFIG, val)["DOCKYARD_VERIFIERS_ENV"])["args"] == {
        "split": "eval"
    }
    no_eval = CONFIG.model_copy(update={"eval_args": None})
    assert json.loads(verifiers_rows.runner_environment(no_eval, val)["DOCKYARD_VERIFIERS_ENV"])["args"] == {
        "split": "train"
    }
    assert env["DOCKYARD_VERIFIERS_RESULT"] == RESULT_FILE
    # The runner's own source: what runs in the session is this module, nothing of dockyard imported.
    assert env["DOCKYARD_VERIFIERS_RUNNER"] == open(verifiers_runner.__file__).read()
    assert (
        "from dockyard" not in env["DOCKYARD_VERIFIERS_RUNNER"]
        and "import dockyard" not in env["DOCKYARD_VERIFIERS_RUNNER"]
    )


@pytest.mark.parametrize(
    ("reward", "status", "passed"),
    [
        (1.0, common_pb2.VERDICT_STATUS_PASSED, 1_000_000),
        (1, common_pb2.VERDICT_STATUS_PASSED, 1_000_000),
        (0.375, common_pb2.VERDICT_STATUS_FAILED, 375_000),
        (0.0, common_pb2.VERDICT_STATUS_FAILED, 0),
    ],
)
def test_a_reward_in_0_1_is_the_verdicts_pass_fraction(reward, status, passed):
    result = json.dumps({"reward": reward, "rewards": {"correct": reward}, "turns": 1})
    assert verifiers_rows.result_error(result) == ""
    verdict = verifiers_rows.verdict(result)
    assert (verdict.status, verdict.tests_passed, verdict.tests_total) == (status, passed, 1_000_000)


@pytest.mark.parametrize(
    ("result", "says"),
    [
        (None, "wrote no result"),
        ("", "wrote no result"),
        ("not json", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"error": "the rubric raised: ZeroDivisionError"}', "the rubric raised: ZeroDivisionError"),
        ('{"reward": 1.5}', "outside [0, 1]"),
        ('{"reward": -0.1}', "outside [0, 1]"),
        ('{"reward": NaN}', "not a finite number"),
        ('{"reward": true}', "not a finite number"),
        ('{"reward": "1"}', "not a finite number"),
        ("{}", "not a finite number"),
    ],
)
def test_anything_else_is_an_error_never_a_reward(result, says):
    assert says in verifiers_rows.result_error(result)
    if result:
        assert verifiers_rows.verdict(result).status == common_pb2.VERDICT_STATUS_ERROR
