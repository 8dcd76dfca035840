"""Environments: config checks, task loading, completion -> sandbox request, integrity zeroing in the collector."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import ConfigError, load_config
from dockyard.tasks import humaneval, swe
from dockyard.tasks.envs import Environment, sandbox_env
from services.coordinator.collector import Collector
from services.coordinator.fleet import Fleet
from services.coordinator.rewards import reward_of
from services.coordinator.task_stream import load_tasks
from tests.conftest import REPO_ROOT

TINY = "examples/configs/tiny_expr.yaml"


def test_env_and_sources_must_match():
    assert load_config(TINY).env.name == "expr"  # the tiny recipe is unchanged
    with pytest.raises(ConfigError, match="data.train.source"):
        load_config(TINY, ["env.name=program_synthesis"])
    with pytest.raises(ConfigError, match="data.train.path"):
        load_config(TINY, ["env.name=swe", "data.train.source=swe", "data.validation.source=swe"])
    cfg = load_config(
        TINY, ["env.name=program_synthesis", "data.train.source=humaneval", "data.validation.source=humaneval"]
    )
    assert cfg.data.train.path is None


def test_humaneval_has_164_problems_in_disjoint_splits():
    problems = humaneval.load_problems()
    assert len(problems) == 164 and len({p.task_id for p in problems}) == 164
    train = {t.task_id for t in humaneval.make_tasks("train", 500)}
    val = {t.task_id for t in humaneval.make_tasks("validation", 500)}
    assert train and val and not train & val and len(train | val) == 164
    assert humaneval.make_tasks("train", 7, seed=3) == humaneval.make_tasks("train", 7, seed=3)


def test_humaneval_completion_is_cut_at_the_next_top_level_statement():
    program = humaneval.program_for("def f(x):\n", "    return x\n\ndef g():\n    pass\n")
    assert program == "def f(x):\n    return x\n\n"


def test_patch_is_extracted_from_a_completion():
    diff = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert swe.extract_patch(f"Here is the fix:\n```diff\n{diff}```\nDone.") == diff
    assert swe.extract_patch(f"Some words\n{diff}") == diff
    assert swe.extract_patch(diff) == diff
    # A header quoted mid-line is prose; the diff starts at the first header that begins a line.
    assert swe.extract_patch(f"I will edit --- the file:\n{diff}") == diff


class FakeSandbox:
    """Answers ScorePatch with one scripted verdict per call and records the requests."""

    def __init__(self, verdicts: list[common_pb2.Verdict]) -> None:
        self.verdicts, self.requests = list(verdicts), []

    async def ScorePatch(self, request, timeout=None):
        self.requests.append(request)
        return sandbox_pb2.ScorePatchResponse(verdict=self.verdicts.pop(0))


class FakeRollout:
    async def Generate(self, request, timeout=None):
        diff = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n"
        completions = [rollout_pb2.Completion(text=f"```diff\n{diff}```", token_ids=[1, 2]) for _ in range(3)]
        return rollout_pb2.GenerateResponse(completions=completions, prompt_token_ids=[0], weight_version=0)


def write_task_set(folder):
    folder.mkdir()
    line = {"instance_id": "i1", "repo": "pypi/x", "problem_statement": "f is wrong", "base_commit": "ab" * 20}
    (folder / "instances.jsonl").write_text(json.dumps(line) + "\n")


async def test_swe_env_scores_through_score_patch_and_integrity_zeroes_the_reward(tmp_path):
    write_task_set(tmp_path / "bugs")
    overrides = ["env.name=swe", "data.train.source=swe", "data.validation.source=swe"]
    overrides += [f"data.train.path={tmp_path / 'bugs'}", f"data.validation.path={tmp_path / 'bugs'}"]
    overrides += ["grpo.num_generations_per_prompt=3", "policy.train_global_batch_size=24"]
    cfg = load_config(TINY, overrides)
    passed = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=4, tests_total=4)
    cheat = common_pb2.Verdict(
        status=common_pb2.VERDICT_STATUS_PASSED,
        tests_passed=4,
        tests_total=4,
        integrity_violation=True,
        protected_paths_touched=["tests/test_m.py"],
    )
    refused = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PATCH_FAILED, tests_total=4)
    sandbox = FakeSandbox([passed, cheat, refused])
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, None))
    fleet.register("sandbox", "sandbox", "127.0.0.1:1").stub = sandbox
    replica = fleet.register("rollout", "rollout", "127.0.0.1:2")
    replica.stub = FakeRollout()
    fleet.set_version(replica, "job", 0)
    routing = SimpleNamespace(required_version=None, admit=None)  # the replica holds the policy: no admission
    buffer = SimpleNamespace(data_plane=None)  # no data plane: the arrays come back in the reply
    collector = Collector("job", cfg, fleet, buffer, routing, max_generations=1, max_scoring=1, generate_timeout=10)
    task = load_tasks(cfg, "train")[0]
    assert task.task_id == "bugs/i1" and "f is wrong" in task.prompt
    group = await collector.make_group(task, "job/s0/g0", seed=0)
    assert [t.reward for t in group.trajectories] == [1.0, 0.0, 0.0]
    assert all(t.valid for t in group.trajectories)  # a cheat or a failed patch is the policy's doing
    request = sandbox.requests[0]
    assert (request.task_set, request.instance_id) == ("bugs", "i1")
    assert request.patch.startswith("--- a/m.py") and request.limits.timeout_seconds == cfg.env.sandbox.timeout_seconds


def test_patch_failed_is_a_zero_reward_not_a_masked_one():
    verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PATCH_FAILED, tests_total=5)
    assert reward_of(verdict, "pass_fraction") == (0.0, True)
    assert reward_of(verdict, "all_pass") == (0.0, True)


def test_expr_env_keeps_the_tiny_recipe_tasks():
    cfg = load_config(TINY)
    from dockyard.tasks.expr import make_tasks

    assert Environment("expr").load("train", cfg.data.train) == make_tasks("train", cfg.data.train.size, 0)


def test_function_families_narrow_the_expr_tasks_and_are_refused_elsewhere():
    cfg = load_config(TINY, ["data.validation.families=[x+b, x*x+b]"])
    tasks = Environment("expr").load("validation", cfg.data.validation)
    assert tasks and {t.task_id.rsplit("-", 1)[1] for t in tasks} == {"x+b", "x*x+b"}
    with pytest.raises(ConfigError, match="data.train.families: function families are for the expr"):
        load_config(
            TINY,
            [
                "env.name=program_synthesis",
                "data.train.source=humaneval",
                "data.validation.source=humaneval",
                "data.train.families=[x+b]",
            ],
        )
    with pytest.raises(ConfigError, match="data.train.families"):
        load_config(TINY, ["data.train.families=[x**3]"])
    # The warm start demonstrates the job's own expr tasks: their families are set once, on the data.
    with pytest.raises(ConfigError, match="policy.bootstrap.families: the warm start demonstrates the job's own"):
        load_config(TINY, ["policy.bootstrap.families=[x+b]"])


def test_swe_task_sets_share_one_task_root(tmp_path, monkeypatch):
    monkeypatch.delenv("DOCKYARD_SANDBOX_TASK_ROOT", raising=False)
    base = ["env.name=swe", "data.train.source=swe", "data.validation.source=swe"]
    train, val = tmp_path / "sets" / "train-set", tmp_path / "sets" / "val-set"
    cfg = load_config(TINY, [*base, f"data.train.path={train}", f"data.validation.path={val}"])
    assert sandbox_env(cfg) == {"DOCKYARD_SANDBOX_TASK_ROOT": str(tmp_path / "sets")}
    assert sandbox_env(load_config(TINY)) == {}
    with pytest.raises(ConfigError, match="same folder"):
        load_config(TINY, [*base, f"data.train.path={train}", f"data.validation.path={tmp_path / 'other' / 'v'}"])


def test_terminal_bench_needs_tools_and_gets_a_docker_sandbox_on_its_task_root(monkeypatch):
    for name in ("DOCKYARD_SANDBOX_TASK_ROOT", "DOCKYARD_SANDBOX_BACKEND", "DOCKYARD_SANDBOX_MAX_SESSIONS"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config("examples/configs/grpo_terminal_bench.yaml")
    assert sandbox_env(cfg) == {
        "DOCKYARD_SANDBOX_TASK_ROOT": str((REPO_ROOT / "examples" / "tasks").resolve()),
        "DOCKYARD_SANDBOX_BACKEND": "docker",
        "DOCKYARD_SANDBOX_MAX_SESSIONS": "32",
    }
    # The local backend would refuse every task (each runs in its own image): refused here, as preflight says.
    monkeypatch.setenv("DOCKYARD_SANDBOX_BACKEND", "local")
    with pytest.raises(
        ValueError, match="terminal_bench runs each task in its own image.*DOCKYARD_SANDBOX_BACKEND=docker"
    ):
        sandbox_env(cfg)
    tasks = Environment("terminal_bench").load("validation", cfg.data.validation)
    assert len(tasks) == 9 and all(t.task_id.startswith("terminal/") for t in tasks)
    with pytest.raises(ConfigError, match="env.tools"):
        load_config("examples/configs/grpo_terminal_bench.yaml", ["env.tools=[]"])


def test_multi_turn_swe_asks_for_edits_and_needs_a_tool_that_makes_them(tmp_path):
    write_task_set(tmp_path / "bugs")
    base = ["env.name=swe", "data.train.source=swe", "data.validation.source=swe"]
    base += [f"data.train.path={tmp_path / 'bugs'}", f"data.validation.path={tmp_path / 'bugs'}"]
    single = load_tasks(load_config(TINY, base), "train")[0]
    tools = "[{name: sh, kind: shell}, {name: done, kind: submit}]"
    agent = load_tasks(load_config(TINY, [*base, f"env.tools={tools}"]), "train")[0]
    assert single.task_id == agent.task_id and "f is wrong" in single.prompt and "f is wrong" in agent.prompt
    assert "unified diff" in single.prompt and "unified diff" not in agent.prompt
    # The config's own submit tool, by its name (not a name the config never gave it).
    assert agent.prompt.endswith("When you are done, call done.\n") and "test files" in agent.prompt
    assert "submit" not in agent.prompt
    with pytest.raises(ConfigError, match="env.tools: multi-turn swe"):
        load_config(TINY, [*base, "env.tools=[{name: look, kind: read_file}, {name: done, kind: submit}]"])
