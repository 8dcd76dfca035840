"""OSWorld behind the multimodal gate: task files, the action parser, the turn input, the plain refusals."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from dockyard.config import ConfigError, load_config
from dockyard.images import ImageLimits, ImageRejected
from dockyard.preflight import SKIP, check_desktop_vm
from dockyard.tasks.envs import Environment, sandbox_env
from dockyard.tasks.osworld import (
    Action,
    ActionError,
    DesktopUnavailable,
    Observation,
    TaskFileError,
    TurnHistory,
    load_tasks,
    parse_actions,
    provider_for,
    read_task,
    turn_input,
)

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "configs" / "grpo_osworld.yaml"
TASKS = REPO / "examples" / "tasks" / "osworld"


def test_the_shipped_task_set_reads_as_osworld_writes_it() -> None:
    calc = read_task(next(TASKS.glob("examples/libreoffice_calc/*.json")))
    assert calc.snapshot == "libreoffice_calc"
    assert [step["type"] for step in calc.config] == ["download", "open"]
    assert calc.evaluator["func"] == ["check_include_exclude", "compare_table"] and calc.evaluator["conj"] == "and"
    tasks = load_tasks(TASKS, 5, seed=0)
    assert len(tasks) == 5 and len({t.task_id for t in tasks[:3]}) == 3  # every task before any repeats
    assert tasks == load_tasks(TASKS, 5, seed=0) != load_tasks(TASKS, 5, seed=1)
    assert all(t.prompt and not t.tests for t in tasks)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.pop("instruction"), "'instruction'"),
        (lambda d: d.update(config=[{"parameters": {}}]), r"config\[0\] needs a 'type'"),
        (lambda d: d.update(evaluator={"result": {}}), "'evaluator' needs a 'func'"),
        (lambda d: d["evaluator"].update(func=["a", "b"], conj="xor"), "conj"),
    ],
)
def test_a_bad_task_file_is_refused_naming_file_and_field(tmp_path: Path, change, named: str) -> None:
    data = json.loads(next(TASKS.glob("examples/chrome/*.json")).read_text())
    change(data)
    path = tmp_path / "chrome" / "t.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    with pytest.raises(TaskFileError, match=named) as info:
        load_tasks(tmp_path, 1, 0)
    assert str(path) in str(info.value)


def test_pyautogui_code_parses_into_actions_without_running_it() -> None:
    completion = """I will open the menu.
```python
pyautogui.click(100, 200, button='left')
pyautogui.write('hello')
time.sleep(0.5)
pyautogui.hotkey('ctrl', 's')
```"""
    assert parse_actions(completion) == [
        Action("click", (100, 200), (("button", "left"),)),
        Action("write", ("hello",)),
        Action("sleep", (0.5,)),
        Action("hotkey", ("ctrl", "s")),
    ]
    assert parse_actions("  DONE\n") == "DONE"
    assert parse_actions("```python\nFAIL\n```") == "FAIL"
    assert parse_actions("pyautogui.scroll(-3)") == [Action("scroll", (-3,))]


@pytest.mark.parametrize(
    ("completion", "says"),
    [
        ("```python\nimport os\n```", "line 1: only calls"),
        (
            "```python\npyautogui.click(1, 2)\nos.system('rm -rf /')\n```",
            "line 2: os.system is not in the action space",
        ),
        ("pyautogui.click(x, 2)", "must be literals"),
        ("pyautogui.screenshot()", "pyautogui.screenshot is not in the action space"),
        ("pyautogui.click(**opts)", "kwargs"),
        ("pyautogui.click(1, 2)\nDONE", "DONE must be the whole answer"),
        ("pyautogui.click(1,", "not Python"),
        ("   ", "no action"),
    ],
)
def test_anything_outside_the_action_space_is_refused_with_its_line(completion: str, says: str) -> None:
    with pytest.raises(ActionError, match=says):
        parse_actions(completion)


def _png(size=(64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", size, (10, 20, 30, 128)).save(out, "PNG")
    return out.getvalue()


def test_a_screenshot_reaches_the_policy_only_through_the_gate() -> None:
    task = read_task(next(TASKS.glob("examples/os/*.json")))
    history = TurnHistory(completions=["pyautogui.click(1, 2)"])
    text, images = turn_input(task, Observation(_png()), history, ImageLimits(allowed=True, max_pixels=10_000))
    assert task.instruction in text and "Turn 1: pyautogui.click(1, 2)" in text
    assert len(images) == 1 and images[0].mode == "RGB" and images[0].size == (64, 48)
    with pytest.raises(ImageRejected, match="allow_multimodal_inputs"):
        turn_input(task, Observation(_png()), history, ImageLimits(allowed=False))
    with pytest.raises(ImageRejected, match=r"screenshot\[0\]: 64x48 = 3072 pixels; at most 1000"):
        turn_input(task, Observation(_png()), history, ImageLimits(allowed=True, max_pixels=1000))


def test_the_config_parses_behind_the_gate_and_launch_refuses_plainly() -> None:
    cfg = load_config(CONFIG)
    assert cfg.env.name == "osworld" and cfg.policy.generation.allow_multimodal_inputs
    with pytest.raises(ConfigError, match="policy.generation.allow_multimodal_inputs: env osworld observes"):
        load_config(CONFIG, ["policy.generation.allow_multimodal_inputs=false"])
    with pytest.raises(ValueError, match="desktop VM provider.*VM image.*controller"):
        sandbox_env(cfg)  # what `dockyard run` calls before starting anything
    with pytest.raises(DesktopUnavailable, match="none is available here"):
        provider_for("http://10.0.0.5:5000")
    finding = check_desktop_vm(cfg)
    assert finding.status == SKIP and "desktop VM image" in finding.message
    assert check_desktop_vm(load_config(REPO / "examples" / "configs" / "tiny_expr.yaml")).status == SKIP
    tasks = Environment("osworld").load("train", cfg.data.train.model_copy(update={"path": str(TASKS)}))
    assert len(tasks) == cfg.data.train.size


def test_preflight_prints_the_stated_vm_skip_and_passes_the_rest(tmp_path: Path) -> None:
    from dockyard.models.vision import build_tiny_vlm
    from dockyard.preflight import Context, errors, preflight, report

    folder = build_tiny_vlm(tmp_path / "vlm")
    cfg = load_config(
        CONFIG,
        [
            f"policy.model_name={folder}",
            "policy.generation.max_new_tokens=64",
            "cluster.device=cpu",
            "cluster.weight_sync_backend=gloo",
            f"logger.log_dir={tmp_path / 'runs'}",
            f"data.train.path={TASKS}",
            f"data.validation.path={TASKS}",
        ],
    )
    findings = preflight(cfg, Context(environ={}))
    printed = report(findings)
    assert errors(findings) == [], printed
    assert "skip   desktop_vm       env osworld needs a desktop VM provider" in printed
    assert f"ok     images           image processor in {folder}" in printed
    assert f"ok     data.train       1024 tasks from {TASKS}" in printed
