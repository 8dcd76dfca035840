"""The example verifiers environment holds out what dockyard's warm start never shows.

The tiny verifiers recipe's warm start demonstrates dockyard's own expression tasks (the train split of
dockyard/tasks/expr.py); the example (examples/verifiers_env) splits its functions by the same rule, so
its eval rows, the recipe's validation, are functions the warm-started policy has never been shown.
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def test_the_environments_eval_rows_are_functions_the_warm_start_never_shows(verifiers_image: str) -> None:
    # The example splits its functions by dockyard's rule, so an eval row is never a training function of
    # the warm start (tiny_expr's demonstrations of dockyard's own train split). Read in the session image,
    # where the environment's package and verifiers are installed.
    from dockyard.tasks.expr import TEST_INPUTS, make_tasks, pool_size

    families = ["x*x+b", "a*x*x+b"]
    listing = (
        "import json, dockyard_verifiers_example as e; "
        f"print(json.dumps({{s: e.functions(s, {families!r}) for s in ('train', 'eval')}}))"
    )
    out = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", verifiers_image, "/opt/venv/bin/python", "-c", listing],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = json.loads(out)

    def values(expr: str) -> tuple[int, ...]:
        return tuple(eval(expr, {"__builtins__": {}}, {"x": x}) for x in TEST_INPUTS)  # the example's own literals

    demonstrated = {
        tuple(int(t.split("==")[1]) for t in task.tests)
        for task in make_tasks("train", pool_size("train", families), families=families)
    }
    assert rows["eval"] and rows["train"]
    assert not {values(expr) for expr in rows["eval"]} & demonstrated
    assert {values(expr) for expr in rows["train"]} <= demonstrated
