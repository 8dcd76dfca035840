"""Preflight of the SFT demonstrations file and the OPD teacher folder: named, with what is wrong."""

from __future__ import annotations

from pathlib import Path

from dockyard.config import load_config
from dockyard.preflight import ERROR, OK, check_demonstrations_and_teacher

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def test_a_bad_demonstrations_file_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n[1]\n')
    [finding] = check_demonstrations_and_teacher(load_config(CONFIGS / "sft.yaml", [f"sft.dataset={path}"]))
    assert finding.status == ERROR and f"{path}:2" in finding.message
    path.write_text('{"prompt": "a", "completion": "b"}\n')
    [finding] = check_demonstrations_and_teacher(load_config(CONFIGS / "sft.yaml", [f"sft.dataset={path}"]))
    assert finding.status == OK


def test_a_missing_teacher_folder_names_the_key(tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    config = load_config(
        CONFIGS / "v4_consolidation.yaml", [f"on_policy_distillation.teacher_model_by_agent_name.expr={teacher}"]
    )
    [finding] = check_demonstrations_and_teacher(config)
    assert finding.status == ERROR
    assert "on_policy_distillation.teacher_model_by_agent_name.expr" in finding.message
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")
    assert [f.status for f in check_demonstrations_and_teacher(config)] == [OK]
