"""Masked fraction and token budget of a mini-swe-agent trial against the built-in scaffold's, on the same task.

    scripted replies ──Session.plan / record (the endpoint's recorder)──> trajectory document ──trial_tokens──> rows

A scripted replay (no model, no container): the same task, the same commands and the same command output,
recorded through the endpoint's session recorder with the character tokenizer (one token per character):
- mini-swe-agent 2.4.6's conversation (its default tool-call mode, mini.yaml's sizes): a system message, the
  instance prompt (~3,000 characters of workflow around the task), each reply a `bash` tool call answered by
  a `tool` message holding its observation JSON; a reply without a tool call is not an action: mini drops it
  from the history and appends its format error (~800 characters) as a user message;
- the built-in scaffold (dockyard/agents/scaffold.py): the task prompt as the user message, the same tool
  calls, each answered by a `tool` message; a reply without a call is answered with an `error: ...` tool
  result (the built-in scaffold keeps every reply).
`--invalid-every K` makes every K-th reply one without a tool call (0: none). Prints, for both: rows, sampled
and total tokens, masked fraction, unique tokens (what grpo.max_trial_tokens counts), the model calls
recorded before the trajectory outgrew `--budget` tokens, and invalid actions, then
`mini_vs_builtin_masked_fraction: R` (mini's masked fraction / the built-in's; 1.0 is parity).
"""

from __future__ import annotations

import argparse
import json

from dockyard.agents.trajectory import trial_tokens
from dockyard.models.tokenizer import build_char_tokenizer
from services.endpoint.rendering import Renderer
from services.endpoint.sessions import Sampled, SessionStore

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"properties": {"command": {}}}}}
PROBLEM = "the parser drops the last field of a row when the row ends with a quoted empty string. " * 15
INSTANCE = f"please solve this issue: {PROBLEM}\n" + "follow the recommended workflow step by step. " * 63
FORMAT_ERROR = "tool call error: no tool calls found in the response. " + "use the bash tool exactly once. " * 24
THOUGHT = "i will look at the code that splits the fields and check the quoting. " * 3


def _reply(renderer: Renderer, thought: str, command: str | None) -> Sampled:
    calls = []
    text = thought
    if command is not None:
        arguments = {"command": command}
        text += "<tool_call>" + json.dumps({"name": "bash", "arguments": arguments}) + "</tool_call>"
        calls = [{"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": arguments}}]
    ids = renderer.encode(text) + [renderer.eos_token_id]
    message = {"role": "assistant", "content": thought, **({"tool_calls": calls} if calls else {})}
    return Sampled(ids, [-0.5] * len(ids), renderer.decode(ids), "eos", message, False)


def _observation(k: int) -> str:
    return json.dumps({"returncode": 0, "output": f"step {k}: " + 'a,b,""\nc,d,e\n' * 40})


def trial(renderer: Renderer, scaffold: str, turns: int, invalid_every: int, budget: int) -> dict:
    session = SessionStore(1, 60, turns + 1).open(scaffold)
    within = turns  # model calls recorded before the trajectory outgrew the budget
    if scaffold == "mini":
        history = [{"role": "system", "content": "you are a helpful assistant that can interact with a computer."}]
        history.append({"role": "user", "content": INSTANCE})
    else:
        history = [{"role": "user", "content": f"{PROBLEM}\nedit the files in the work folder, then submit."}]
    for k in range(turns):
        invalid = invalid_every > 0 and k % invalid_every == invalid_every - 1 and k < turns - 1
        sampled = _reply(renderer, THOUGHT, None if invalid else f"grep -n split src/parse.py | head -{k + 5}")
        session.record(session.plan(renderer, history, [BASH]), [sampled], 1, [1])
        if within == turns and trial_tokens(session.trajectory(), max_tokens=budget).truncated:
            within = k
        if invalid and scaffold == "mini":
            history = [*history, {"role": "user", "content": FORMAT_ERROR}]  # the reply dropped
        elif invalid:
            history = [*history, sampled.message, {"role": "user", "content": "error: no tool call; call a tool"}]
        else:
            history = [*history, sampled.message, {"role": "tool", "content": _observation(k)}]
    document = session.trajectory()
    tokens = trial_tokens(document, max_tokens=10**9)
    total, sampled_tokens = tokens.total_tokens, tokens.sampled_tokens
    return {
        "rows": len(tokens.segments),
        "sampled": sampled_tokens,
        "total": total,
        "masked_fraction": 1.0 - sampled_tokens / total,
        # A recorder without the unique count (before it existed) counted the rows' sum.
        "unique": getattr(tokens, "unique_tokens", total),
        f"turns_within_{budget}": within,
        "invalid_actions": document["invalid_actions"],
        "abandoned": document.get("abandoned", {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--invalid-every", type=int, default=2)
    parser.add_argument("--budget", type=int, default=8192, help="grpo.max_trial_tokens to count turns within")
    args = parser.parse_args()
    renderer = Renderer(build_char_tokenizer())
    results = {s: trial(renderer, s, args.turns, args.invalid_every, args.budget) for s in ("mini", "builtin")}
    for scaffold, r in results.items():
        print(scaffold, json.dumps(r))
    ratio = results["mini"]["masked_fraction"] / results["builtin"]["masked_fraction"]
    print(f"mini_vs_builtin_masked_fraction: {ratio:.3f}")


if __name__ == "__main__":
    main()
