"""A stored job whose values no longer fit is refused by name; a record never breaks its proto."""

from __future__ import annotations

import pytest

from dockyard.config import load_config_text
from dockyard.jobs import SUCCEEDED
from services.coordinator.jobs import JobRecord

CONFIG = "policy: {model: {model_type: qwen2}, train_global_batch_size: 64}\n"


def record() -> JobRecord:
    return JobRecord(job_id="job", config=load_config_text(CONFIG), config_yaml=CONFIG, run_dir="runs/job")


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"step": 2**64}, ["'job'", "step", "int64"]),
        ({"sync_epoch": -(2**70)}, ["sync_epoch", "int64"]),
        ({"config_yaml": CONFIG + "grpo: {max_num_steps: 9223372036854775808}\n"}, ["'job'", "max_num_steps"]),
        ({"metrics": {"loss": "not a number"}}, ["'job'"]),
        ({"cursor": 7}, ["'job'"]),
    ],
)
def test_a_document_that_does_not_fit_is_a_value_error_naming_it(changes: dict, words: list[str]) -> None:
    document = record().to_document() | changes
    with pytest.raises(ValueError) as info:
        JobRecord.from_document(document)
    for word in words:
        assert word in str(info.value)


def test_a_record_that_cannot_be_shown_in_full_is_shown_by_id_state_and_why() -> None:
    broken = record()
    broken.state = SUCCEEDED
    broken.weight_version = 2**64
    job = broken.to_proto()
    assert (job.job_id, job.state) == ("job", SUCCEEDED)
    assert "cannot be shown" in job.message
    assert record().to_proto().max_steps == 20
