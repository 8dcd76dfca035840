"""OSWorld (computer use) tasks and the loop contract of a desktop trial, behind the multimodal gate.

    <task set>/examples/<domain>/<id>.json   (OSWorld's evaluation_examples; `examples/` optional)
        id, instruction, snapshot, config steps, evaluator ──load_tasks──> OsworldTask ──> Task(prompt)

    one trial, turn by turn (a DesktopProvider drives the VM):
        provider.reset(task)  ─ runs the task's config steps in a fresh VM ─> Observation(screenshot PNG)
        observation ──turn_input: screenshot through dockyard/images.py's gate──> (text, [RGB image])
            ──rollout Generate(prompt, images)──> completion
        completion ──parse_actions (pyautogui-style code, parsed, never executed here)──> [Action] | WAIT | DONE | FAIL
        provider.step(actions) ─> next Observation ... until DONE / FAIL / the step budget
        provider.evaluate(task) ─ the evaluator spec, run in the VM ─> reward in [0, 1]

Guarantees: a task file is read as OSWorld's harness reads it (its field names); one without an id,
an instruction or an evaluator with a `func`, or with a config step that has no `type`, is refused
with the file and field named. `load_tasks` is deterministic for (path, n, seed) like every task
set. `parse_actions` accepts only what OSWorld's pyautogui action space is made of: calls of
`pyautogui.<function>` (ACTION_FUNCTIONS) and `time.sleep` with literal arguments, or one of the
special answers WAIT, DONE, FAIL; anything else (an import, a name, an expression, another call) is
refused with its line, so nothing a policy writes is ever run as code. A screenshot reaches the
policy only through the multimodal gate (the config requires
policy.generation.allow_multimodal_inputs for env osworld).

What does not run here: a desktop trial needs a VM provider, and dockyard ships none.
`provider_for` always refuses with DESKTOP_REQUIREMENTS (a VM image with OSWorld's in-VM controller,
a hypervisor or cloud provider to start it, the controller's endpoint reachable from the sandbox
fleet); `dockyard run` refuses the job at launch and `dockyard preflight` reports it as a stated skip.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dockyard.images import ImageLimits, gate_images
from dockyard.tasks.task import Task, draw

DESKTOP_REQUIREMENTS = (
    "env osworld needs a desktop VM provider, and none is available here: it would need OSWorld's desktop "
    "VM image (Ubuntu with the apps of the task set and OSWorld's in-VM controller server on port 5000), "
    "a provider that starts one VM per trial (VMware/VirtualBox/KVM with nested virtualisation, Docker "
    "with /dev/kvm, or a cloud such as AWS), and that controller's endpoint reachable from the sandbox "
    "fleet; dockyard ships the task reader and the loop contract (dockyard/tasks/osworld.py), not a provider"
)
SPECIAL_ANSWERS = ("WAIT", "DONE", "FAIL")
# OSWorld's pyautogui action space (the functions its agents emit), by pyautogui's names.
ACTION_FUNCTIONS = frozenset(
    {
        "click",
        "doubleClick",
        "tripleClick",
        "rightClick",
        "middleClick",
        "moveTo",
        "moveRel",
        "dragTo",
        "dragRel",
        "mouseDown",
        "mouseUp",
        "scroll",
        "hscroll",
        "vscroll",
        "write",
        "typewrite",
        "press",
        "keyDown",
        "keyUp",
        "hotkey",
    }
)
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


class TaskFileError(ValueError):
    """An OSWorld task file that cannot be read; the message names the file and the field."""


class ActionError(ValueError):
    """A completion that is not an action of the space; the message names the line and what is wrong."""


class DesktopUnavailable(RuntimeError):
    """No desktop VM provider: the message says what one would need (DESKTOP_REQUIREMENTS)."""


@dataclass(frozen=True)
class OsworldTask:
    task_id: str
    instruction: str
    snapshot: str  # the VM snapshot the task starts from ("chrome", "libreoffice_calc", ...)
    config: tuple[dict[str, Any], ...]  # setup steps: {"type": "launch" | "download" | "open" | ..., "parameters"}
    evaluator: dict[str, Any]  # {"func": str | [str], "result": ..., "expected": ..., "conj": "and" | "or"}
    related_apps: tuple[str, ...] = ()

    def as_task(self) -> Task:
        # The reference stays with the evaluator (run in the VM); the prompt is the instruction.
        return Task(task_id=self.task_id, prompt=self.instruction, tests=(), solution="")


@dataclass(frozen=True)
class Action:
    """One pyautogui call (`pyautogui.<name>(*args, **kwargs)`), or `sleep`, with literal arguments only."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Observation:
    screenshot: bytes  # PNG bytes of the desktop, as OSWorld's controller returns them
    accessibility_tree: str | None = None


@dataclass
class TurnHistory:
    """What the trial has done so far: the completions and actions of earlier turns."""

    completions: list[str] = field(default_factory=list)
    actions: list[list[Action] | str] = field(default_factory=list)


class DesktopProvider(Protocol):
    """What a trial needs from a desktop VM (OSWorld's DesktopEnv offers these three)."""

    def reset(self, task: OsworldTask) -> Observation: ...

    def step(self, actions: list[Action]) -> Observation: ...

    def evaluate(self, task: OsworldTask) -> float: ...


def provider_for(endpoint: str | None = None) -> DesktopProvider:
    """The desktop VM provider of a trial; none is available here, so this always refuses plainly."""
    raise DesktopUnavailable(DESKTOP_REQUIREMENTS)


def read_task(path: Path) -> OsworldTask:
    """One task file in OSWorld's format, or TaskFileError naming the file and the field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskFileError(f"{path}: not a readable JSON task file: {exc}") from None
    if not isinstance(data, dict):
        raise TaskFileError(f"{path}: a task file holds one JSON object, got {type(data).__name__}")
    for key in ("id", "instruction"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise TaskFileError(f"{path}: field {key!r} must be a non-empty string")
    steps = data.get("config", [])
    if not isinstance(steps, list):
        raise TaskFileError(f"{path}: field 'config' must be a list of setup steps")
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("type"), str):
            raise TaskFileError(f"{path}: config[{i}] needs a 'type' (launch, download, open, execute, ...)")
    evaluator = data.get("evaluator")
    if not isinstance(evaluator, dict) or not evaluator.get("func"):
        raise TaskFileError(f"{path}: field 'evaluator' needs a 'func' (e.g. match_in_list, or infeasible)")
    funcs = evaluator["func"] if isinstance(evaluator["func"], list) else [evaluator["func"]]
    if not all(isinstance(f, str) and f for f in funcs):
        raise TaskFileError(f"{path}: evaluator.func must be a function name or a list of them")
    if len(funcs) > 1 and evaluator.get("conj", "and") not in ("and", "or"):
        raise TaskFileError(f"{path}: evaluator.conj must be 'and' or 'or'")
    return OsworldTask(
        task_id=data["id"],
        instruction=data["instruction"].strip(),
        snapshot=str(data.get("snapshot", "")),
        config=tuple(steps),
        evaluator=evaluator,
        related_apps=tuple(str(a) for a in data.get("related_apps", [])),
    )


def task_files(path: str | Path) -> list[Path]:
    """The task files of a task set: <path>/examples/<domain>/*.json, or <path>/<domain>/*.json."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"data path {root} is not a folder of OSWorld tasks (<domain>/<id>.json)")
    base = root / "examples" if (root / "examples").is_dir() else root
    files = sorted(base.glob("*/*.json"))
    if not files:
        raise ValueError(f"{base} holds no OSWorld task files (<domain>/<id>.json)")
    return files


def load_tasks(path: str | Path, n: int, seed: int) -> list[Task]:
    """n tasks drawn from the task set (seeded permutations, cycling), each file checked."""
    tasks = [read_task(f).as_task() for f in task_files(path)]
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: task id {duplicate!r} appears in more than one file")
    return draw(tasks, n, f"osworld:{seed}")


def turn_input(
    task: OsworldTask, observation: Observation, history: TurnHistory, limits: ImageLimits
) -> tuple[str, list[Any]]:
    """The prompt text of one turn and its screenshot, through the multimodal gate (ImageRejected if refused)."""
    images = gate_images([observation.screenshot], limits, field="screenshot")
    lines = [
        f"Task: {task.instruction}",
        "Answer with pyautogui calls in a ```python block, or WAIT, DONE or FAIL.",
    ]
    recent = history.completions[-3:]  # the last turns only: each costs context, the screenshot shows the state
    for number, completion in enumerate(recent, len(history.completions) - len(recent) + 1):
        lines.append(f"Turn {number}: {completion}")
    if observation.accessibility_tree:
        lines.append(f"Accessibility tree:\n{observation.accessibility_tree}")
    return "\n".join(lines), images


def parse_actions(completion: str) -> list[Action] | str:
    """A completion as OSWorld's pyautogui action space: a list of Actions, or "WAIT" / "DONE" / "FAIL"."""
    stripped = completion.strip()
    if stripped in SPECIAL_ANSWERS:
        return stripped
    blocks = _CODE_BLOCK.findall(completion)
    code = "\n".join(blocks) if blocks else stripped
    if not code.strip():
        raise ActionError("completion: no action (a ```python block of pyautogui calls, or WAIT, DONE or FAIL)")
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise ActionError(f"line {exc.lineno}: not Python: {exc.msg}") from None
    actions = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Name) and node.value.id in SPECIAL_ANSWERS:
            if actions:
                raise ActionError(f"line {node.lineno}: {node.value.id} must be the whole answer, not follow actions")
            return node.value.id
        actions.append(_action(node))
    return actions


def _action(node: ast.stmt) -> Action:
    where = f"line {node.lineno}"
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        raise ActionError(f"{where}: only calls like pyautogui.click(x, y) are actions, not {type(node).__name__}")
    call = node.value
    target = call.func
    if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
        raise ActionError(f"{where}: call pyautogui.<function> or time.sleep, not {ast.unparse(target)}")
    module, name = target.value.id, target.attr
    if (module, name) == ("time", "sleep"):
        name = "sleep"
    elif module != "pyautogui" or name not in ACTION_FUNCTIONS:
        known = ", ".join(sorted(ACTION_FUNCTIONS))
        raise ActionError(f"{where}: {module}.{name} is not in the action space (pyautogui: {known}; time.sleep)")
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = tuple((k.arg, ast.literal_eval(k.value)) for k in call.keywords if k.arg is not None)
    except ValueError:
        raise ActionError(f"{where}: arguments of {module}.{name} must be literals (numbers, strings, lists)") from None
    if len(kwargs) != len(call.keywords):
        raise ActionError(f"{where}: **kwargs are not allowed in {module}.{name}")
    return Action(name=name, args=args, kwargs=kwargs)
