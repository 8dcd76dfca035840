"""Your own program datasets: field mapping, errors naming file/line/field, splits, program_bench, chat prompts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow
import pyarrow.parquet
import pytest

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.config import ConfigError, load_config, load_config_text
from dockyard.preflight import ERROR, OK, check_tokenizer_and_context
from dockyard.tasks import humaneval
from dockyard.tasks.programs import code_of, program_for
from dockyard.tasks.task import Task
from services.coordinator.collector import Collector
from services.coordinator.fleet import Fleet
from services.coordinator.task_stream import load_tasks
from tests.conftest import REPO_ROOT

TINY = str(REPO_ROOT / "examples" / "configs" / "tiny_expr.yaml")
PROGRAMS = ["env.name=program_synthesis", "data.train.source=humaneval", "data.validation.source=humaneval"]
RANDOM_INIT = ["policy.model_name=null", "policy.bootstrap=null"]


def rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"id": f"sq-{i}", "question": f"write sq returning x*x ({i})", "asserts": [f"assert sq({i}) == {i * i}"]}
        for i in range(start, start + n)
    ]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def config(*overrides: str, env: list[str] = PROGRAMS):
    return load_config(TINY, [*env, *overrides])


MAPPING = ["data.train.fields.prompt=question", "data.train.fields.tests=asserts", "data.train.fields.id=id"]
VAL_MAPPING = [m.replace("data.train", "data.validation") for m in MAPPING]


def test_a_train_and_a_validation_file_are_each_taken_whole(tmp_path: Path) -> None:
    train, val = write_jsonl(tmp_path / "t.jsonl", rows(12)), write_jsonl(tmp_path / "v.jsonl", rows(3, start=100))
    cfg = config(f"data.train.path={train}", f"data.validation.path={val}", *MAPPING, *VAL_MAPPING)
    cfg.data.train.size, cfg.data.validation.size = 12, 3
    got_train, got_val = load_tasks(cfg, "train"), load_tasks(cfg, "validation")
    assert sorted(t.task_id for t in got_train) == sorted(f"sq-{i}" for i in range(12))  # no hash split
    assert sorted(t.task_id for t in got_val) == ["sq-100", "sq-101", "sq-102"]
    task = next(t for t in got_val if t.task_id == "sq-101")
    assert task.prompt == "write sq returning x*x (101)" and task.tests == ("assert sq(101) == 10201",)
    assert not task.completes_prompt and task.messages == ()
    # The coordinator reads the resolved config (every default written out): the same tasks.
    assert load_tasks(load_config_text(cfg.resolved_yaml()), "validation") == got_val


def test_one_file_serving_both_splits_is_split_by_hash(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "t.jsonl", rows(40))
    cfg = config(f"data.train.path={train}", *MAPPING, "data.train.size=40", "data.validation.size=40")
    train_ids = {t.task_id for t in load_tasks(cfg, "train")}
    val_ids = {t.task_id for t in load_tasks(cfg, "validation")}
    assert train_ids and val_ids and not train_ids & val_ids and len(train_ids | val_ids) == 40
    assert val_ids == {f"sq-{i}" for i in range(40) if humaneval.split_of(f"sq-{i}") == "validation"}


def test_answer_solution_metadata_and_messages_are_carried(tmp_path: Path) -> None:
    row = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "define one()"}],
        "tests": "assert one() == 1\nassert one() + 1 == 2\n",
        "answer": 1,
        "solution": "def one():\n    return 1\n",
        "difficulty": "easy",
        "source": "mine",
    }
    path = write_jsonl(tmp_path / "m.jsonl", [row])
    meta = "data.validation.fields.metadata=[difficulty]"
    cfg = config(
        f"data.validation.path={path}", f"data.train.path={tmp_path / 'x.jsonl'}", "data.validation.size=1", meta
    )
    [task] = load_tasks(cfg, "validation")
    assert task.messages == (("system", "be brief"), ("user", "define one()")) and task.prompt == "define one()"
    assert task.tests == (row["tests"],) and task.answer == 1 and task.solution == row["solution"]
    assert task.metadata == {"difficulty": "easy"} and task.task_id == "m.jsonl:1"


def test_parquet_and_humaneval_shaped_rows_keep_humaneval_meaning(tmp_path: Path) -> None:
    problems = humaneval.load_problems()[:3]
    path = tmp_path / "he.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([p.__dict__ for p in problems]), path)
    cfg = config(f"data.validation.path={path}", "data.validation.size=3", f"data.train.path={tmp_path / 'x.jsonl'}")
    got = sorted(load_tasks(cfg, "validation"), key=lambda t: t.task_id)
    assert got == sorted((humaneval.task_of(p) for p in problems), key=lambda t: t.task_id)
    assert all(t.completes_prompt for t in got)
    assert program_for(got[0], "    return 1\ndef g(): pass\n") == got[0].prompt + "    return 1\n"


def test_program_bench_mixes_humaneval_with_your_sources(tmp_path: Path) -> None:
    extra = write_jsonl(
        tmp_path / "extra.jsonl",
        [{"task_id": r["id"], "prompt": r["question"], "tests": r["asserts"]} for r in rows(8)],
    )
    bench = ["env.name=program_bench", "data.train.source=program_bench", "data.validation.source=program_bench"]
    sources = f"data.train.sources=[{{path: {extra}}}]"
    cfg = config(sources, "data.train.size=200", "data.validation.size=200", env=bench)
    train, val = load_tasks(cfg, "train"), load_tasks(cfg, "validation")
    he_train = {t.task_id for t in train if t.task_id.startswith("HumanEval/")}
    he_val = {t.task_id for t in val if t.task_id.startswith("HumanEval/")}
    assert he_train and he_val and not he_train & he_val  # HumanEval serves both, hash split
    mine_train = {t.task_id for t in train if t.task_id.startswith("sq-")}
    mine_val = {t.task_id for t in val if t.task_id.startswith("sq-")}
    assert mine_train | mine_val == {f"sq-{i}" for i in range(8)} and not mine_train & mine_val


@pytest.mark.parametrize(
    ("row", "mapping", "message"),
    [
        ({"question": "q"}, MAPPING, r"t.jsonl:2: missing field tests \(column 'asserts'"),
        ({"asserts": ["assert 1"]}, MAPPING, r"t.jsonl:2: missing field prompt \(column 'question'\) or messages"),
        ({"question": "q", "asserts": []}, MAPPING, r"t.jsonl:2: field tests \(column 'asserts'\) is Python test"),
        ({"question": 3, "asserts": ["assert 1"]}, MAPPING, r"t.jsonl:2: field prompt \(column 'question'\) is int"),
        ({"question": "q", "asserts": ["assert 1"]}, MAPPING, r"t.jsonl:2: missing field id \(column 'id'"),
        (
            {"task_id": "x", "prompt": "def f():\n", "entry_point": "f", "test": 5},
            [],
            r"t.jsonl:2: field test \(column 'test'\) is int",
        ),
    ],
)
def test_a_bad_row_names_file_line_and_field(tmp_path: Path, row: dict, mapping: list[str], message: str) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [rows(1)[0] if mapping else {"prompt": "p", "tests": "assert 1"}, row])
    cfg = config(f"data.train.path={path}", *mapping)
    with pytest.raises(ValueError, match=message):
        load_tasks(cfg, "train")
    findings = {
        f.check: f
        for f in check_tokenizer_and_context(
            load_config(TINY, [*PROGRAMS, *RANDOM_INIT, f"data.train.path={path}", *mapping]), False
        )
    }
    assert findings["data.train"].status == ERROR and "t.jsonl:2" in findings["data.train"].message


def test_code_of_takes_the_first_fenced_block_else_the_whole_completion() -> None:
    assert code_of("Here:\n```python\ndef f():\n    return 1\n```\nand ```x```") == "def f():\n    return 1\n"
    assert code_of("def f():\n    return 2\n\n") == "def f():\n    return 2\n"
    task = Task(task_id="t", prompt="p", tests=("assert f() == 1",), solution="")
    assert program_for(task, "```py\ndef f(): return 1\n```") == "def f(): return 1\n"


def test_chat_template_needs_one_at_preflight(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(8))
    base = [*PROGRAMS, *RANDOM_INIT, f"data.train.path={path}", *MAPPING]
    cfg = load_config(TINY, [*base, "data.chat_template=true", "policy.generation.max_new_tokens=8"])
    findings = {f.check: f for f in check_tokenizer_and_context(cfg, False)}
    assert findings["context"].status == OK  # the built-in tokenizer has a chat template
    # The rendered prompt ("user: ...\nassistant: ") is what is measured: longer than the text alone.
    longest = max(len(r["question"]) for r in rows(8))
    assert f"longest prompt {longest + len('user: ') + len('assistant: ') + 1} " in findings["context"].message


class RecordingRollout:
    """Answers Generate with one fixed completion per sample, recording each request."""

    def __init__(self) -> None:
        self.requests: list[rollout_pb2.GenerateRequest] = []

    async def Generate(self, request, timeout=None):
        self.requests.append(request)
        completion = rollout_pb2.Completion(
            text="def sq(x):\n    return x*x\n", token_ids=[5, 6], logprobs=[-1.0, -1.0]
        )
        return rollout_pb2.GenerateResponse(
            completions=[completion] * request.num_samples, prompt_token_ids=[7, 8, 9], weight_version=0
        )


class RecordingSandbox:
    def __init__(self) -> None:
        self.requests: list[sandbox_pb2.RunTestsRequest] = []

    async def RunTests(self, request, timeout=None):
        self.requests.append(request)
        verdict = common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=1, tests_total=1)
        return sandbox_pb2.RunTestsResponse(verdict=verdict)


NO_DATA_PLANE = SimpleNamespace(data_plane=None)  # a buffer whose groups' arrays come back in each reply


def collector_for(cfg) -> tuple[Collector, RecordingRollout, RecordingSandbox]:
    rollout, sandbox = RecordingRollout(), RecordingSandbox()
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, None))
    fleet.register("sandbox", "sandbox", "127.0.0.1:1").stub = sandbox
    replica = fleet.register("rollout", "rollout", "127.0.0.1:2")
    replica.stub = rollout
    fleet.set_version(replica, "job", 0)
    routing = SimpleNamespace(required_version=None, admit=None)
    return (
        Collector("job", cfg, fleet, NO_DATA_PLANE, routing, max_generations=1, max_scoring=2, generate_timeout=10),
        rollout,
        sandbox,
    )


async def test_the_collector_sends_chat_messages_and_ignore_eos_and_trains_on_the_rendered_ids() -> None:
    cfg = config("data.chat_template=true", "policy.generation.ignore_eos=true", "grpo.num_generations_per_prompt=2")
    collector, rollout, sandbox = collector_for(cfg)
    task = Task(task_id="sq", prompt="write sq", tests=("assert sq(3) == 9",), solution="")
    group = await collector.make_group(task, "job/s0/g0", seed=0)
    [request] = rollout.requests
    assert request.prompt == "" and [(m.role, m.content) for m in request.messages] == [("user", "write sq")]
    assert request.sampling.ignore_eos
    assert all(list(t.prompt_token_ids) == [7, 8, 9] for t in group.trajectories)  # the rollout's rendering
    assert sandbox.requests[0].program == "def sq(x):\n    return x*x\n"
    assert list(sandbox.requests[0].tests) == ["assert sq(3) == 9"]
    await collector.validate([task], version=0)
    assert rollout.requests[-1].sampling.ignore_eos and rollout.requests[-1].sampling.temperature == 0.0
    # A task with messages is always sent as messages; a text prompt without chat_template as text.
    plain, plain_rollout, _ = collector_for(config())
    chat = Task(task_id="c", prompt="hi", tests=("assert 1",), solution="", messages=(("system", "s"), ("user", "hi")))
    await plain.make_group(chat, "job/s0/g1", seed=0)
    await plain.make_group(task, "job/s0/g2", seed=0)
    first, second = plain_rollout.requests
    assert [(m.role, m.content) for m in first.messages] == [("system", "s"), ("user", "hi")] and not first.prompt
    assert second.prompt == "write sq" and not second.messages and not second.sampling.ignore_eos


def test_sources_are_refused_where_they_would_be_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.train.sources: mixing files is for program_synthesis"):
        load_config(TINY, [f"data.train.sources=[{{path: {tmp_path / 'x.jsonl'}}}]"])
