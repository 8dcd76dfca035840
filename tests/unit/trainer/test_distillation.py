"""On-policy distillation on the trainer: the teacher is loaded frozen and the student moves toward it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dockyard.config import ConfigError, load_config_text
from services.trainer.batch import build_batch
from services.trainer.logprobs import token_logprobs
from services.trainer.policy import PolicyTrainer
from tests.unit.trainer.test_policy import CONFIG, _group

OPD = [
    "grpo.adv_estimator.name=opd",
    "grpo.async_grpo.enabled=true",
    "loss_fn.is_correction=tis",
    "loss_fn.is_max=2.0",
]


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher of the student's shape and tokenizer that puts its mass on the completion "2*x"."""
    folder = tmp_path_factory.mktemp("teacher")
    trainer = PolicyTrainer(load_config_text(CONFIG, ["policy.seed=7", "policy.optimizer.lr=0.01"]))
    tok = trainer.tokenizer
    rows = [(tok("f(1)=2 f(x)=")["input_ids"], tok("2*x", add_special_tokens=False)["input_ids"])] * 4
    for _ in range(30):
        trainer.sft_step(rows)
    trainer.save(folder)
    return folder


def _sequence_logprob(model: torch.nn.Module, policy: PolicyTrainer, group, row: int) -> float:
    batch = build_batch([group], policy.tokenizer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.slice(row, row + 1), 1.0)
    return float((lp * batch.token_mask[row : row + 1]).sum())


def test_opd_steps_move_the_student_toward_the_teacher(teacher_folder: Path) -> None:
    config = load_config_text(
        CONFIG, [*OPD, f"+on_policy_distillation.teacher_model_by_agent_name.expr={teacher_folder}"]
    )
    student = PolicyTrainer(config)
    assert student.teacher is not None and not any(p.requires_grad for p in student.teacher.parameters())
    # Rewards say the opposite of the teacher: with OPD they must not matter.
    group = _group(student, ["2*x", "x+9", "x*x", "7"], [0.0, 1.0, 1.0, 1.0])
    teacher = [_sequence_logprob(student.teacher, student, group, i) for i in range(4)]
    before = [_sequence_logprob(student.model, student, group, i) for i in range(4)]
    metrics = [student.train_step([group]) for _ in range(3)]
    after = [_sequence_logprob(student.model, student, group, i) for i in range(4)]
    assert after[0] > before[0] + 0.5, f"student log p('2*x') {before[0]:.2f} -> {after[0]:.2f}"
    gap_before = sum(abs(t - b) for t, b in zip(teacher, before, strict=True))
    gap_after = sum(abs(t - a) for t, a in zip(teacher, after, strict=True))
    assert gap_after < gap_before, (gap_before, gap_after)
    assert all("teacher_kl" in m for m in metrics)
    # The teacher is frozen: unchanged, and none of its parameters is in the optimizer.
    assert [_sequence_logprob(student.teacher, student, group, i) for i in range(4)] == teacher
    teacher_ids = {id(q) for q in student.teacher.parameters()}
    assert not any(id(p) in teacher_ids for g in student.optimizer.param_groups for p in g["params"])


def test_grpo_jobs_load_no_teacher(teacher_folder: Path) -> None:
    config = load_config_text(CONFIG, [f"+on_policy_distillation.teacher_model_by_agent_name.expr={teacher_folder}"])
    assert PolicyTrainer(config).teacher is None


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    other = PolicyTrainer(load_config_text(CONFIG, ["+policy.model.vocab_size=200"]))
    other.save(tmp_path / "other")
    config = load_config_text(
        CONFIG, [*OPD, f"+on_policy_distillation.teacher_model_by_agent_name.expr={tmp_path / 'other'}"]
    )
    with pytest.raises(ConfigError, match="teacher_model_by_agent_name.expr=.*share the student's tokenizer"):
        PolicyTrainer(config)
    config = load_config_text(
        CONFIG, [*OPD, f"+on_policy_distillation.teacher_model_by_agent_name.expr={tmp_path / 'none'}"]
    )
    with pytest.raises(FileNotFoundError, match="teacher_model_by_agent_name.expr=.*no config.json"):
        PolicyTrainer(config)
