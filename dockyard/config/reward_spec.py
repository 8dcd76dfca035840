"""How a reward is written in `env.reward`: a built-in name, `module:function` or `file.py:function`.

Guarantees: pure text checks, no file or import touched, so the config refuses a malformed reward
at load with the same message `dockyard.tasks.reward_functions` (which finds and reads the function)
gives; that module takes these from here.
"""

from __future__ import annotations

import re

BUILTIN_REWARDS = ("pass_fraction", "all_pass")
SPEC = re.compile(r"^(?P<target>[^:\s][^:]*):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def syntax_error(spec: str) -> str | None:
    """Why `spec` is neither a built-in reward nor `module:function` / `file.py:function`; None if it is."""
    if spec in BUILTIN_REWARDS:
        return None
    match = SPEC.match(spec)
    if match is None:
        return (
            f"{spec!r} is not a reward: use one of {', '.join(BUILTIN_REWARDS)}, "
            "'package.module:function' or 'path/to/file.py:function'"
        )
    target = match["target"]
    if not target.endswith(".py") and not MODULE.match(target):
        return f"{spec!r}: {target!r} is neither a dotted module name nor a path ending in .py"
    return None
