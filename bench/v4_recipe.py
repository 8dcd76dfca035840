"""The V4-style consolidation recipe at tiny scale on CPU: per-domain SFT, per-domain GRPO, then one
student distilled from both experts. Prints each domain's teacher and student validation pass rates
and their ratio.

    data: expression demonstrations (an imperfect demonstrator)   HumanEval-format programs (written here)
    pass 1  SFT (examples/configs/sft.yaml, sft.dataset)  ─> expr-sft          programs-sft
    pass 2  GRPO (v4_expr.yaml, v4_programs.yaml)          ─> expr teacher      programs teacher
    pass 3  student: SFT on both domains' demonstrations and the teachers' passing trials (export-sft)
            ─> OPD on expr (v4_consolidation.yaml) ─> OPD on programs ─> the consolidated student
    measure the student on expr with a job that validates before its first step

Every job is a real job on one LocalStack (five services, real gRPC); the student is measured by the
same validation (greedy, the sandbox) as the teachers. The programs domain: a function f(a, b) whose
docstring says what it returns in words ("the sum of first and the product of second and three":
`a + (b * 3)`); the completion is its body; each problem's tests check three points. Its split is
HumanEval's (a hash of task_id).

`--smoke` runs every pass with a few steps (a check that the recipe runs, not that it learns).
Prints per domain: `teacher T  student S  ratio S/T`, and `min_ratio: R` last (higher is better;
the recipe asks for at least 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import time
from pathlib import Path

from dockyard.config import load_config
from dockyard.recipes.tiny_expr import SHORTCUT_RATE, line_through_first_two
from dockyard.stack import LocalStack
from dockyard.tasks import expr
from dockyard.tasks.demonstrations import export_best_trials

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
OPS = {"sum": "+", "difference": "-", "product": "*"}
# Operands in words: each is a word of its own (a lookup, as the operations are), never a letter
# that the signature also shows.
NAMES = {
    "first": "a",
    "second": "b",
    **{w: str(i) for i, w in enumerate("one two three four five six seven eight nine".split(), 1)},
}
POINTS = ((2, 5), (-3, 4), (7, -1))
# The student's SFT mixture: the expression domain weighted about as the files' lengths weight it,
# so the student keeps it; the distillation on programs, longer and with a larger step, brings that
# domain back (see docs/algorithms.md for the mixtures and distillation lengths measured).
SHARES = {"expr": 7, "programs": 1}


def programs(path: Path) -> list[dict]:
    """HumanEval-format problems: f(a, b) returns an arithmetic expression described in words."""
    shapes = []
    for (name, sym), x, (y, code_y) in itertools.product(OPS.items(), ("first", "second"), NAMES.items()):
        shapes.append((f"the {name} of {x} and {y}", f"{NAMES[x]} {sym} {code_y}"))
        if y in ("first", "second"):
            for (name2, sym2), (z, code_z) in itertools.product(OPS.items(), NAMES.items()):
                words = f"the {name} of {x} and the {name2} of {y} and {z}"
                shapes.append((words, f"{NAMES[x]} {sym} ({code_y} {sym2} {code_z})"))
    problems = []
    for i, (words, code) in enumerate(shapes):
        asserts = "".join(f"    assert candidate({a}, {b}) == {eval(code, {'a': a, 'b': b})}\n" for a, b in POINTS)
        problems.append(
            {
                "task_id": f"programs/{i}",
                "prompt": f'def f(a, b):\n    """return {words}."""\n',
                "entry_point": "f",
                "canonical_solution": f"    return {code}",
                "test": f"def check(candidate):\n{asserts}",
            }
        )
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return problems


def demonstrations(work: Path) -> None:
    """Pass 1's datasets: expression tasks answered by the imperfect demonstrator of the tiny recipe
    (the line through the first two points, SHORTCUT_RATE of the time), and the programs' training split."""
    from dockyard.tasks.humaneval import split_of

    rng = random.Random(0)
    tasks = expr.make_tasks("train", 4096, 0)
    rows = [(t.prompt, line_through_first_two(t) if rng.random() < SHORTCUT_RATE else t.solution) for t in tasks]
    expr_path = work / "expr-demos.jsonl"
    expr_path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
    programs_path = work / "programs-demos.jsonl"
    train = [p for p in programs(work / "programs.jsonl") if split_of(p["task_id"]) == "train"]
    programs_path.write_text(
        "".join(json.dumps({"prompt": p["prompt"], "completion": p["canonical_solution"]}) + "\n" for p in train)
    )


def domain(name: str, work: Path) -> list[str]:
    """Overrides that point a config at one domain."""
    if name == "expr":
        return []
    path = work / "programs.jsonl"
    return [
        "env.name=program_synthesis",
        "data.train.source=humaneval",
        f"data.train.path={path}",
        "data.validation.source=humaneval",
        f"data.validation.path={path}",
    ]


async def run_job(address: str, config_yaml: str) -> Path:
    from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
    from dockyard.rpc.client import connect

    async with connect(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        job = (await stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml))).job
        while True:
            job = (await stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.job_id))).job
            if job.state == coordinator_pb2.JOB_STATE_SUCCEEDED:
                return Path(job.run_dir)
            if job.state in (coordinator_pb2.JOB_STATE_FAILED, coordinator_pb2.JOB_STATE_CANCELLED):
                raise SystemExit(f"job {job.job_id} ended {job.state}: {job.message}")
            await asyncio.sleep(0.5)


def validation(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["pass_rate"]) for r in records if r["kind"] == "validation"]


class Recipe:
    def __init__(self, stack: LocalStack, work: Path, steps: dict[str, int]) -> None:
        self.stack, self.work, self.steps = stack, work, steps

    def job(self, label: str, config: str, overrides: list[str]) -> tuple[Path, list[tuple[int, float]]]:
        common = [f"logger.log_dir={self.work / 'runs'}", "logger.plot=false"]
        cfg = load_config(CONFIGS / config, [*common, *overrides])
        t0 = time.perf_counter()
        run_dir = asyncio.run(run_job(self.stack.address("coordinator"), cfg.resolved_yaml()))
        scores = validation(run_dir)
        print(f"{label:<28} {time.perf_counter() - t0:7.1f} s  validation {scores}", flush=True)
        return run_dir, scores

    def sft(self, name: str, dataset: Path, dom: str) -> Path:
        out, steps = self.work / name, self.steps["sft"]
        overrides = [f"sft.dataset={dataset}", f"sft.max_num_steps={steps}", f"checkpointing.checkpoint_dir={out}"]
        self.job(f"sft {name}", "sft.yaml", [*overrides, *domain(dom, self.work)])
        return out / f"step-{steps}"

    def grpo(self, dom: str, start: Path) -> tuple[Path, float, Path]:
        out, steps = self.work / f"{dom}-grpo", self.steps["grpo"]
        config = "v4_expr.yaml" if dom == "expr" else "v4_programs.yaml"
        overrides = [f"policy.model_name={start}", f"grpo.max_num_steps={steps}", f"checkpointing.checkpoint_dir={out}"]
        run_dir, scores = self.job(f"grpo {dom}", config, [*overrides, *domain(dom, self.work)])
        return out / f"step-{steps}", scores[-1][1], run_dir

    def opd(self, dom: str, start: Path, teachers: dict[str, Path]) -> tuple[Path, float]:
        out, steps = self.work / f"student-opd-{dom}", self.steps[f"opd_{dom}"]
        overrides = [
            f"policy.model_name={start}",
            f"grpo.max_num_steps={steps}",
            f"checkpointing.checkpoint_dir={out}",
            *(f"on_policy_distillation.teacher_model_by_agent_name.{k}={v}" for k, v in teachers.items()),
        ]
        _, scores = self.job(f"opd {dom}", "v4_consolidation.yaml", [*overrides, *domain(dom, self.work)])
        return out / f"step-{steps}", scores[-1][1]

    def measure(self, dom: str, model: Path, dataset: Path) -> float:
        """The pass rate of `model` on `dom`: the validation before the first step of a one-step job."""
        overrides = [
            f"policy.model_name={model}",
            f"sft.dataset={dataset}",
            "sft.max_num_steps=1",
            "sft.val_at_start=true",
            "sft.val_at_end=false",
            "checkpointing.enabled=false",
        ]
        _, scores = self.job(f"measure {dom}", "sft.yaml", [*overrides, *domain(dom, self.work)])
        assert scores[0][0] == 0
        return scores[0][1]


def mixture(files: dict[str, list[Path]], shares: dict[str, int]) -> str:
    """The lines of every domain's files, each domain's cycled to `shares[domain]` × as many lines as
    the largest domain has, so the student sees the domains in those proportions."""
    lines = {dom: [line for path in paths for line in path.read_text().splitlines()] for dom, paths in files.items()}
    unit = max(len(v) for v in lines.values()) // max(shares.values())
    return "".join(
        line + "\n" for dom, v in lines.items() for line in itertools.islice(itertools.cycle(v), unit * shares[dom])
    )


def experts(recipe: Recipe, work: Path, expr_demos: Path, programs_demos: Path) -> dict[str, dict]:
    """Passes 1 and 2: each domain's SFT model, its GRPO expert, the expert's score and passing trials."""
    sft_models = {"expr": recipe.sft("expr-sft", expr_demos, "expr")}
    sft_models["programs"] = recipe.sft("programs-sft", programs_demos, "programs")
    found = {}
    for dom in ("expr", "programs"):
        model, score, run_dir = recipe.grpo(dom, sft_models[dom])
        best = work / f"{dom}-best.jsonl"
        print(f"  {export_best_trials(run_dir, best, 1.0)} passing trials of the {dom} teacher exported")
        found[dom] = {"model": str(model), "score": score, "best": str(best)}
    (work / "teachers.json").write_text(json.dumps(found, indent=1))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few steps per pass")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "v4-bench", help="folder of the recipe's files")
    parser.add_argument(
        "--consolidate-only", action="store_true", help="pass 3 alone, with the experts a previous run left in --work"
    )
    args = parser.parse_args()
    if args.smoke:
        steps = {"sft": 4, "grpo": 2, "opd_expr": 2, "opd_programs": 2}
    else:
        steps = {"sft": 800, "grpo": 20, "opd_expr": 15, "opd_programs": 40}
    work = args.work.resolve()
    if not args.consolidate_only:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        demonstrations(work)
    expr_demos, programs_demos = work / "expr-demos.jsonl", work / "programs-demos.jsonl"
    stack = LocalStack(work / "logs", free_ports=True)
    stack.start()
    t0 = time.perf_counter()
    try:
        recipe = Recipe(stack, work, steps)
        if args.consolidate_only:
            found = json.loads((work / "teachers.json").read_text())
        else:
            found = experts(recipe, work, expr_demos, programs_demos)
        mixed = work / "student-demos.jsonl"
        by_domain = {"expr": [expr_demos], "programs": [programs_demos]}
        files = {dom: [*paths, Path(found[dom]["best"])] for dom, paths in by_domain.items()}
        mixed.write_text(mixture(files, SHARES))
        by_agent = {"expr": found["expr"]["model"], "program_synthesis": found["programs"]["model"]}
        student = recipe.sft("student-sft", mixed, "expr")
        student, _ = recipe.opd("expr", student, by_agent)
        student, student_programs = recipe.opd("programs", student, by_agent)
        student_expr = recipe.measure("expr", student, expr_demos)
    finally:
        stack.stop()
    print(f"recipe wall time: {time.perf_counter() - t0:.0f} s")
    ratios = []
    for dom, student_score in (("expr", student_expr), ("programs", student_programs)):
        teacher = found[dom]["score"]
        ratio = student_score / teacher if teacher > 0 else float("nan")
        ratios.append(ratio)
        print(f"{dom:<10} teacher {teacher:.3f}  student {student_score:.3f}  ratio {ratio:.3f}")
    print(f"min_ratio: {min(ratios):.3f}")


if __name__ == "__main__":
    main()
