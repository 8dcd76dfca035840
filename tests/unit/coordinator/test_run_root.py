"""With a run root, a job's run folder and checkpoints stay inside it, whatever its config says."""

from __future__ import annotations

from pathlib import Path

import pytest

from dockyard.config import load_config_text
from dockyard.rpc.errors import InvalidArgument
from services.coordinator.run_folder import confine

CONFIG = "policy:\n  model: {model_type: qwen2, hidden_size: 32}\n"


def config_with(**logger_and_checkpoints: str):
    log_dir = logger_and_checkpoints.get("log_dir", "runs")
    text = CONFIG + f"logger: {{log_dir: {log_dir!r}}}\n"
    if "checkpoint_dir" in logger_and_checkpoints:
        text += f"checkpointing: {{checkpoint_dir: {logger_and_checkpoints['checkpoint_dir']!r}}}\n"
    return load_config_text(text)


def test_relative_and_inside_folders_are_taken_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    confined = confine(config_with(log_dir="team-a"), str(root))
    assert confined.logger.log_dir == str(root / "team-a")
    assert confined.checkpoint_folder("j") == root / "team-a" / "j" / "checkpoints"
    inside = confine(config_with(log_dir=str(root / "b"), checkpoint_dir="ck"), str(root))
    assert (inside.logger.log_dir, inside.checkpointing.checkpoint_dir) == (str(root / "b"), str(root / "ck"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("log_dir", "/etc"), ("log_dir", "../../outside"), ("checkpoint_dir", "/tmp/elsewhere"), ("log_dir", "link/x")],
)
def test_folders_outside_the_root_are_refused_naming_the_field(tmp_path: Path, field: str, value: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)  # a symlink inside that points out
    with pytest.raises(InvalidArgument, match=f"{field} .* outside this coordinator's run root"):
        confine(config_with(**{field: value}), str(root))


def test_without_a_root_the_folders_are_used_as_given() -> None:
    config = config_with(log_dir="/anywhere")
    assert confine(config, "") is config


def test_a_local_mlflow_store_stays_inside_the_root_and_a_server_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()

    def mlflow_uri(uri: str) -> str | None:
        config = load_config_text(CONFIG + f"logger: {{mlflow: {{tracking_uri: {uri!r}}}}}\n")
        return confine(config, str(root)).logger.mlflow.tracking_uri

    assert mlflow_uri("file:mlruns") == (root / "mlruns").as_uri()
    assert mlflow_uri(str(root / "shared")) == (root / "shared").as_uri()
    assert mlflow_uri("https://mlflow.example:5000") == "https://mlflow.example:5000"
    for outside in ("file:///etc/mlruns", "/tmp/elsewhere"):
        with pytest.raises(InvalidArgument, match="logger.mlflow.tracking_uri .* outside"):
            mlflow_uri(outside)
