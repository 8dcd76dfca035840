"""Where a recovered job puts its task stream: the stored cursor around the trainer's step, or
the trainer's checkpoint, with new group ids when the trainer may have gone back to one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dockyard.api.trainer.v1 import trainer_pb2
from dockyard.config import load_config_text
from dockyard.jobs import RUNNING
from services.coordinator.jobs import JobRecord
from services.coordinator.producer import GroupIds
from services.coordinator.recovery import Recovery
from services.coordinator.run_folder import RunFolder
from services.coordinator.task_stream import TaskStream

CONFIG = """
policy:
  model: {model_type: qwen2, hidden_size: 32}
  train_global_batch_size: 4
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2, max_num_steps: 9}
"""
CURSOR = {"step": 5, "tasks_drawn_before": 8, "tasks_drawn_after": 10, "next_group_index": 3, "run_number": 1}


def recovery(tmp_path: Path, cursor: dict) -> Recovery:
    config = load_config_text(CONFIG)
    record = JobRecord("job-a", config, config.resolved_yaml(), str(tmp_path / "job-a"), state=RUNNING, cursor=cursor)
    return Recovery(
        record,
        trainer=None,
        buffer=None,
        weights=None,
        tasks=TaskStream([], seed=0),
        ids=GroupIds("job-a", seed=0),
        folder=RunFolder(tmp_path / "job-a"),
        recovering=True,
        checkpointing=True,
        recovery_timeout=5.0,
    )


def loaded(version: int, resumed_from: str = "", tasks_drawn: int | None = None) -> trainer_pb2.LoadPolicyResponse:
    data_state = "" if tasks_drawn is None else f'{{"tasks_drawn": {tasks_drawn}}}'
    return trainer_pb2.LoadPolicyResponse(weight_version=version, resumed_from=resumed_from, data_state=data_state)


def test_cursor_of_the_next_step_or_of_the_step_just_trained(tmp_path: Path) -> None:
    # The trainer has not taken step 5: its tasks are drawn again, its groups keep their ids.
    r = recovery(tmp_path, CURSOR)
    assert r.tasks_drawn_at(loaded(4)) == 8
    assert (r.ids.run_number, r.ids.next_index, r.ids.prefix, r.rewind) == (1, 3, "job-a/r1", False)
    # The trainer took step 5 while the coordinator was down: continue after its tasks.
    assert recovery(tmp_path, CURSOR).tasks_drawn_at(loaded(5)) == 10


def test_a_trainer_back_from_an_older_checkpoint(tmp_path: Path) -> None:
    r = recovery(tmp_path, CURSOR)
    assert r.tasks_drawn_at(loaded(2, "ckpt/step-2", tasks_drawn=4)) == 4
    assert (r.ids.run_number, r.ids.next_index, r.ids.prefix, r.rewind) == (2, 0, "job-a/r2", True)


def test_no_cursor_yet_and_a_cursor_nothing_explains(tmp_path: Path) -> None:
    fresh = recovery(tmp_path, {})
    assert fresh.tasks_drawn_at(loaded(0)) == 0
    assert fresh.ids.prefix == "job-a"
    with pytest.raises(RuntimeError, match="cursor is at step 5"):
        recovery(tmp_path, CURSOR).tasks_drawn_at(loaded(0))
