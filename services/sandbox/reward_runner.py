"""Reward functions run in the sandbox: the Reward RPC's domain code.

    source + function + input JSON ──backend.execute(files, ["python", HARNESS_NAME, INPUT_NAME], limits)──>
        HARNESS (in the sandbox): reads INPUT_NAME, deletes it, exec's the source, calls
            function(task, completion, verdict); its prints go to stderr; one report line on stdout:
            "<nonce> {"value": ...}" or "<nonce> {"error": "raised ValueError: ..."}"
    ──interpret──> (reward, Outcome)   PASSED with the reward, or ERROR naming the function and why

The contract (docs/rewards.md): the function returns a finite number, a bool (a pass/fail verdict:
1.0 or 0.0), or a dict with a finite number under "reward" (other keys are ignored). Anything else --
raising, NaN or inf, a string, None, no return before the time limit, dying to a limit -- is an
ERROR outcome (masked out of the group statistics, never a zero reward) whose message starts with
"reward function <origin>" and says why; an integer beyond any float (10**400) is such an ERROR too.
A request is sized before anything runs (reward_arguments): source, function name and input_json by
their lengths, the input's nesting by its depth (MAX_INPUT_DEPTH); over a limit is INVALID_ARGUMENT.

Guarantees: the function runs only through the backend's execute, so under the same isolation and
limits as RunTests on both backends (no network, no host files, bounded time, memory and output);
its source and input reach it as files of its own work folder; the report must carry the per-call
nonce (read from the input file, which the harness deletes before any user code runs), so neither
the function's own output nor a completion it prints can pass for a result. Not covered, as for
RunTests: code that introspects the harness's memory can recover the nonce.
"""

from __future__ import annotations

import json
import math
import secrets

from dockyard.rpc.errors import InvalidArgument
from services.sandbox.backend import Outcome, ResourceLimits, SandboxBackend, Status

HARNESS_NAME = "dockyard_reward_harness.py"
INPUT_NAME = "dockyard_reward_input.json"
# The reported value (and an error text) are kept to this many characters in messages.
MESSAGE_CHARS = 500
# A Reward request's bounds, checked before anything runs (docs/limits.md).
MAX_SOURCE_CHARS = 1 << 20
MAX_FUNCTION_CHARS = 256
MAX_INPUT_CHARS = 8 << 20
MAX_INPUT_DEPTH = 64

HARNESS_SOURCE = r"""
import json, os, sys, traceback


def _main():
    with open(sys.argv[1], "rb") as f:
        payload = json.load(f)
    os.unlink(sys.argv[1])  # the nonce is in it: gone before user code runs
    nonce, write, exit_ = payload.pop("nonce"), os.write, os._exit
    out = os.dup(1)
    os.set_inheritable(out, False)
    os.dup2(2, 1)  # the function's prints go to stderr; stdout carries the report only

    def report(obj):
        write(out, (nonce + " " + json.dumps(obj) + "\n").encode())

    try:
        namespace = {"__name__": "dockyard_reward_function", "__file__": payload["origin"]}
        exec(compile(payload["source"], payload["origin"], "exec"), namespace)
        function = namespace.get(payload["function"])
        if not callable(function):
            report({"error": f"defines no function {payload['function']!r}"})
            exit_(0)
        args = payload["input"]
        value = function(args["task"], args["completion"], args["verdict"])
    except BaseException as exc:
        try:
            traceback.print_exc()
            report({"error": f"raised {type(exc).__name__}: {exc}"})
        except BaseException:
            pass
        exit_(0)
    if isinstance(value, dict) and "reward" in value:
        value = {"reward": value["reward"]}  # other keys are ignored: they need not be JSON, nor small
    elif isinstance(value, dict):
        value = {"keys": [str(k)[:40] for k in list(value)[:10]]}
    try:
        encoded = json.dumps({"value": value})
    except BaseException:
        report({"error": f"returned a {type(value).__name__}, not a number, a bool or a dict"})
        exit_(0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    write(out, (nonce + " " + encoded + "\n").encode())
    exit_(0)


_main()
"""


def interpret(value: object) -> tuple[float | None, str]:
    """(reward, "") for a value the contract accepts, else (None, why not)."""
    if isinstance(value, bool):
        return float(value), ""
    if isinstance(value, dict):
        if "reward" not in value:
            return None, f"returned a dict without a 'reward' key (keys: {value.get('keys', sorted(value)[:10])})"
        return interpret_number(value["reward"], "returned {'reward': %s}")
    return interpret_number(value, "returned %s")


def interpret_number(value: object, shape: str) -> tuple[float | None, str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, (shape % f"a {type(value).__name__}") + ", not a number"
    try:
        reward = float(value)
    except OverflowError:  # an int beyond any float (10**400)
        return None, (shape % "an integer beyond any float") + ", not a finite number"
    if not math.isfinite(reward):
        return None, (shape % reward) + ", not a finite number"
    return reward, ""


def reward_arguments(source: str, function: str, input_json: str) -> dict:
    """The function's three arguments from `input_json`, every part of the request sized first;
    InvalidArgument naming the field and its limit."""
    if len(source) > MAX_SOURCE_CHARS:
        raise InvalidArgument(f"source: {len(source)} characters; at most {MAX_SOURCE_CHARS}")
    if len(function) > MAX_FUNCTION_CHARS or not function.isidentifier():
        raise InvalidArgument(f"function: {function[:80]!r} is not a Python identifier of at most {MAX_FUNCTION_CHARS}")
    if len(input_json) > MAX_INPUT_CHARS:
        raise InvalidArgument(f"input_json: {len(input_json)} characters; at most {MAX_INPUT_CHARS}")
    try:
        arguments = json.loads(input_json)
    except RecursionError:
        raise InvalidArgument(f"input_json: nested deeper than {MAX_INPUT_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidArgument(f"input_json: not JSON ({exc})") from None
    if _depth(arguments) > MAX_INPUT_DEPTH:
        raise InvalidArgument(f"input_json: nested deeper than {MAX_INPUT_DEPTH} levels")
    if not isinstance(arguments, dict) or not {"task", "completion", "verdict"} <= arguments.keys():
        raise InvalidArgument('input_json: must be an object with "task", "completion" and "verdict"')
    return arguments


def _depth(value: object) -> int:
    """How deep `value` nests (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def parse_report(stdout: str, nonce: str) -> dict | None:
    """The harness's report (the last stdout line carrying the nonce), or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1 :])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None


def _error(origin: str, why: str, outcome: Outcome) -> tuple[float, Outcome]:
    message = f"reward function {origin}: {why[:MESSAGE_CHARS]}"
    return 0.0, Outcome(
        Status.ERROR,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        output_truncated=outcome.output_truncated,
        duration_seconds=outcome.duration_seconds,
        error_message=message,
    )


async def run_reward(
    backend: SandboxBackend, source: str, function: str, origin: str, input_json: dict, limits: ResourceLimits
) -> tuple[float, Outcome]:
    """(reward, PASSED outcome), or (0.0, ERROR outcome naming `origin` and why)."""
    nonce = secrets.token_hex(16)
    payload = {"nonce": nonce, "source": source, "function": function, "origin": origin, "input": input_json}
    files = {HARNESS_NAME: HARNESS_SOURCE, INPUT_NAME: json.dumps(payload)}
    outcome = await backend.execute(files, ["python", HARNESS_NAME, INPUT_NAME], limits)
    if outcome.status is Status.ERROR:
        return _error(origin, f"the sandbox could not run it: {outcome.error_message}", outcome)
    if outcome.status is Status.TIMEOUT:
        return _error(origin, f"timed out after {limits.timeout_seconds:g} s", outcome)
    report = parse_report(outcome.stdout, nonce)
    if report is None:
        tail = outcome.stderr.strip().splitlines()[-1:] or [outcome.error_message or "no output"]
        return _error(origin, f"ended (exit code {outcome.exit_code}) without returning: {tail[0]}", outcome)
    if "error" in report:
        return _error(origin, str(report["error"]), outcome)
    reward, why = interpret(report.get("value"))
    if reward is None:
        return _error(origin, why, outcome)
    return reward, Outcome(
        Status.PASSED,
        stderr=outcome.stderr,
        output_truncated=outcome.output_truncated,
        duration_seconds=outcome.duration_seconds,
    )
