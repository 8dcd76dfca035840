"""The `env` section: the environment, its reward, sandbox limits, tools or scaffold, and the hle judge.

Guarantees: a reward is checked for syntax at load (reward_spec.py; the function itself is found
later, by the coordinator and preflight); tool names differ, at most one submits, and the built-in
tools and an external scaffold exclude each other.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from dockyard.config.reward_spec import syntax_error as reward_syntax_error
from dockyard.config.sampling import MIN_TEMPERATURE, OPENAI_MAX_TEMPERATURE
from dockyard.config.section import Section
from dockyard.config.tools import ScaffoldConfig, ToolConfig
from dockyard.config.verifiers import VerifiersConfig, runner_scaffold

MAX_REWARD_TERMS = 16


class SandboxLimits(Section):
    timeout_seconds: float = Field(
        10.0,
        gt=0.0,
        description=(
            "Wall clock per program (for swe: per patch application and test run); the RPC deadline is this + 30 s."
        ),
    )
    memory_mb: int = Field(512, ge=16, le=1 << 20, description="Address-space cap (RLIMIT_AS), at least 16.")
    cpu_seconds: float = Field(10.0, gt=0.0, description="CPU time cap (RLIMIT_CPU, rounded up to whole seconds).")
    max_output_bytes: Literal[0] | Annotated[int, Field(ge=256, le=1 << 30)] = Field(
        16384,
        description=(
            "Captured output cap per stream, at least 256; 0 leaves it to the sandbox (its default; "
            "for ScorePatch its ceiling, `DOCKYARD_SANDBOX_MAX_OUTPUT_BYTES`). A SWE test log is "
            "graded whole whatever this cap."
        ),
    )


class RewardTerm(Section):
    """One reward of a weighted sum (env.reward as a list)."""

    reward: str = Field(description="A built-in reward or a function, written as env.reward names one.")
    weight: float = Field(1.0, allow_inf_nan=False, description="Its factor in the sum.")

    @model_validator(mode="after")
    def _reward_syntax(self) -> RewardTerm:
        problem = reward_syntax_error(self.reward)
        if problem is not None:
            raise ValueError(f"env.reward: {problem}")
        return self


# The hle judge's prompt (dockyard/tasks/qa_judge.py), HLE's style: the extracted answer, then yes or no.
JUDGE_TEMPLATE = """You grade an answer to an exam question. Decide whether the response's final answer \
means the same as the correct answer given below; judge only that, not the reasoning.

[question]: {question}

[response]: {response}

[correct_answer]: {correct_answer}

Reply in exactly this format:
extracted_final_answer: the final answer the response gives, copied exactly, or None if it gives none
reasoning: one or two sentences comparing extracted_final_answer with [correct_answer] (numbers may \
differ by a small rounding margin; anything else that differs makes it wrong)
correct: yes if extracted_final_answer matches [correct_answer], otherwise no
"""
JUDGE_PLACEHOLDERS = ("{question}", "{response}", "{correct_answer}")


class JudgeConfig(Section):
    """The model judge of env hle (dockyard/tasks/qa_judge.py), HLE's style: asked through the policy endpoint."""

    enabled: bool = Field(
        False,
        description=(
            "Ask the judge about every response the sandbox's answer rules reject: its yes passes it, "
            "a failed call is an ERROR verdict (masked); `dockyard run` then starts the policy "
            "endpoint. `env.name=hle` only."
        ),
    )
    prompt_template: str | None = Field(
        None,
        min_length=1,
        max_length=16384,
        description=(
            "The judge's one user message, with `{question}`, `{response}` and `{correct_answer}` "
            "(all three required); `null`: `dockyard.config.JUDGE_TEMPLATE`."
        ),
    )
    max_new_tokens: int = Field(256, ge=1, le=32768, description="Length cap of the judge's reply.")
    temperature: float = Field(
        0.0,
        ge=MIN_TEMPERATURE,
        le=OPENAI_MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="Sampling temperature of the judge (0 = greedy).",
    )
    timeout_seconds: float = Field(
        120.0,
        gt=0.0,
        le=3600.0,
        allow_inf_nan=False,
        description="Time limit of one judge call (one retry on a connection error or 5xx).",
    )

    @model_validator(mode="after")
    def _placeholders(self) -> JudgeConfig:
        template = self.prompt_template or JUDGE_TEMPLATE
        if missing := [p for p in JUDGE_PLACEHOLDERS if p not in template]:
            raise ValueError(f"env.judge.prompt_template must hold {', '.join(missing)}")
        return self


class EnvConfig(Section):
    name: Literal[
        "expr",
        "expr_agent",
        "program_synthesis",
        "program_bench",
        "swe",
        "terminal_bench",
        "hle",
        "gdpval",
        "osworld",
        "verifiers",
    ] = Field(
        "expr",
        description=(
            "Environment, i.e. how a completion is scored ([sandbox.md](sandbox.md#environments)): "
            "`expr` (the tiny recipe: the first line is `f`'s body, RunTests), `program_synthesis` "
            "(HumanEval, or your own files of prompt + tests rows, [datasets.md](datasets.md): "
            "RunTests of the program against the row's tests), `program_bench` (HumanEval plus your "
            "files, mixed), `swe` (the completion's unified diff, ScorePatch; as an agent, the "
            "session's work folder, ScoreSession), `expr_agent` (the expression task with no points "
            "shown: the agent reads f through a tool, and its submitted answer is scored as `expr` "
            "scores a completion; needs `env.tools`), `terminal_bench` (tasks in terminal-bench's "
            "folder format or Harbor's (task.toml, Terminal-Bench 2): the agent works in the task's "
            "container, then the task's tests run there "
            "and decide the verdict, ScoreSession; needs `env.tools` and the docker sandbox backend, "
            "[terminal_tasks.md](terminal_tasks.md)), `hle` (questions with one final answer: the "
            "last `Answer:` line, exact match after normalisation or the chosen letter, RunTests; "
            "optionally a model judge, `env.judge`), `gdpval` (file-producing tasks: the deliverables "
            "the agent leaves, checked by the task's checker.py in the session, ScoreSession; needs "
            "`env.tools` with a file-changing tool), both in [environments.md](environments.md), "
            "`osworld` (computer use: OSWorld task files, screenshots through the multimodal gate, "
            "pyautogui-style actions; needs a desktop VM provider, which is not available: refused at "
            "launch, a stated skip in preflight, [osworld.md](osworld.md)), `verifiers` (a verifiers "
            "environment, `env.verifiers`: each trial is one rollout of one of its rows, run in the "
            "trial's session by its own code, scored by its rubric; docker backend, "
            "[environments.md](environments.md#verifiers-environments-of-the-verifiers-package)). Each takes its own "
            "`data.*.source`: `expr`, `humaneval`, `program_bench`, `swe`, `expr_agent`, "
            "`terminal_bench`, `qa`, `gdpval`, `osworld`, `verifiers`."
        ),
    )
    reward: str | list[RewardTerm] = Field(
        "pass_fraction",
        description=(
            "Verdict → reward: `pass_fraction` = tests passed / tests total; `all_pass` = 1 if PASSED "
            "else 0; `package.module:function` or `path/to/file.py:function` (relative to the working "
            "directory): a Python function called as `function(task, completion, verdict)` **in the "
            'sandbox**, returning a finite number, a bool or `{"reward": number}` '
            "([rewards.md](rewards.md)); or a list of `{reward: <one of those>, weight: <number, "
            "default 1.0>}` whose weighted sum is the reward (at most 16 terms). An ERROR verdict is "
            "an invalid trajectory in every case, and so is a function that raises, times out or "
            "returns NaN, inf or a non-number (never a 0 reward); PATCH_FAILED is a reward of 0; a "
            "verdict with `integrity_violation` is zeroed (`apply_integrity`) before any penalty. "
            "`dockyard preflight` checks each function's file and definition without running it."
        ),
    )
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    tools: list[ToolConfig] = Field(
        default_factory=list,
        description="Non-empty: each trial is a multi-turn agent loop of the built-in scaffold with these "
        "tools, in a sandbox session (docs/agents.md); empty: one completion per sample.",
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    scaffold: ScaffoldConfig | None = Field(
        None,
        description="Set: each trial runs this external scaffold in its sandbox session (docker backend), whose "
        "only network route is the policy endpoint (docs/agents.md#external-scaffolds). With env.name verifiers it "
        "is dockyard's verifiers runner, set by dockyard (`null` or that runner).",
    )
    verifiers: VerifiersConfig | None = Field(
        None,
        description="The verifiers environment of env.name verifiers (required there, refused elsewhere): "
        "[environments.md](environments.md#verifiers-environments-of-the-verifiers-package).",
    )

    @model_validator(mode="after")
    def _reward(self) -> EnvConfig:
        if isinstance(self.reward, str) and (problem := reward_syntax_error(self.reward)) is not None:
            raise ValueError(f"env.reward: {problem}")
        if isinstance(self.reward, list) and not 1 <= len(self.reward) <= MAX_REWARD_TERMS:
            raise ValueError(f"env.reward: a list of 1 to {MAX_REWARD_TERMS} {{reward, weight}} terms")
        return self

    @property
    def reward_terms(self) -> list[tuple[str, float]]:
        """(reward, weight) pairs; a single reward is one term of weight 1."""
        if isinstance(self.reward, str):
            return [(self.reward, 1.0)]
        return [(term.reward, term.weight) for term in self.reward]

    @model_validator(mode="after")
    def _tool_names(self) -> EnvConfig:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"env.tools: names must differ, got {names}")
        if [t.kind for t in self.tools].count("submit") > 1:
            raise ValueError("env.tools: at most one tool of kind submit (it ends the trial with its answer)")
        if self.judge.enabled and self.name != "hle":
            raise ValueError(f"env.judge grades question answering (env.name=hle), not env.name={self.name}")
        if self.tools and self.scaffold is not None:
            raise ValueError("env.tools are the built-in scaffold's; an external env.scaffold brings its own tools")
        return self

    @model_validator(mode="after")
    def _verifiers(self) -> EnvConfig:
        if (self.name == "verifiers") != (self.verifiers is not None):
            raise ValueError("env.verifiers names the environment of env.name verifiers, and only there")
        if self.verifiers is None:
            return self
        if self.tools:
            raise ValueError("env.tools are the built-in scaffold's; a verifiers environment brings its own tools")
        runner = runner_scaffold()
        if self.scaffold is not None and self.scaffold != runner:
            raise ValueError("env.scaffold: env.name verifiers runs dockyard's verifiers runner, not another scaffold")
        # Every external-scaffold path (session route, image, errors) then serves it; set without re-validating.
        self.__dict__["scaffold"] = runner
        return self

    @property
    def agentic(self) -> bool:
        return bool(self.tools) or self.scaffold is not None
