"""An external scaffold's failure is its trial's, not the job's.

A non-zero exit (before any model call: the session the coordinator opened holds no call), the time
limit, garbage output and a scaffold that never called the model each become a masked trial (no tokens,
ERROR, marked as a scaffold error) with the scaffold's stderr tail; they are counted per step
(`scaffold_errors`), written to samples.jsonl, never make a group be generated again, and only more than
`env.scaffold.max_error_fraction` of a step's worth of trials fails the job, naming the scaffold and
its last error. The scaffold runs in a fake sandbox (its SessionExec answers as the scaffold would have
ended) and talks to a fake endpoint (POST /v1/sessions, the trajectory read) through httpx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest

from dockyard.agents.contract import SAMPLING_GREEDY, SAMPLING_HEADER
from dockyard.agents.external import SCAFFOLD_ERROR_PREFIX, TAIL_CHARS, is_scaffold_error
from dockyard.agents.scaffold import TrialLost
from dockyard.api.common.v1 import common_pb2
from dockyard.api.sandbox.v1 import sandbox_pb2
from dockyard.cli.views import fleet_summary
from dockyard.config import load_config
from services.coordinator.agent_trials import AgentTrials
from services.coordinator.collector import Collector, CollectStats
from services.coordinator.fleet import Fleet
from services.coordinator.group_errors import GroupUnscorable
from services.coordinator.producer import GroupIds, SyncProducer
from services.coordinator.run_folder import RunFolder
from services.coordinator.scaffold_errors import ScaffoldErrors, ScaffoldFailing
from services.coordinator.step_metrics import StepMetrics
from services.coordinator.task_stream import TaskStream, load_tasks
from tests.conftest import REPO_ROOT

CONFIG = REPO_ROOT / "examples" / "configs" / "tiny_agent_external.yaml"
PACKAGE = "mini-swe-agent==2.4.6"


@dataclass
class Ends:
    """How the scaffold's command ends in the fake sandbox."""

    exit_code: int = 0
    stderr: str = ""
    timed_out: bool = False
    calls_model: bool = True  # the endpoint records a sampled turn in its session
    answer: bytes | None = None  # the answer file's bytes (None: no such file)


OK = Ends()
CRASH = Ends(
    exit_code=3, calls_model=False, stderr="Traceback (most recent call last):\nImportError: no module named litellm\n"
)


class NotFound(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such file")


class FakeSandbox:
    """A sandbox worker's session calls; each session's command ends as `ends` says: the next of a list
    (the last repeats), or what a function of the OpenSession request (the task's files) gives."""

    def __init__(self, endpoint: FakeEndpoint, ends) -> None:
        self.endpoint, self.opened = endpoint, 0
        self.ends = ends if callable(ends) else lambda request, i: ends[min(i, len(ends) - 1)]
        self.sessions: dict[str, Ends] = {}
        self.answers: dict[str, bytes | None] = {}

    async def OpenSession(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.sessions[request.request_id] = self.ends(request, self.opened)
        self.opened += 1
        return sandbox_pb2.OpenSessionResponse(
            session_id=request.request_id, work_dir="/work", endpoint_url="http://127.0.0.1:8080"
        )

    async def SessionExec(self, request, timeout=None):  # noqa: N802
        ends = self.sessions[request.session_id]
        if ends.calls_model:
            self.endpoint.called.add(request.session_id)
        self.answers[request.session_id] = ends.answer
        status = common_pb2.VERDICT_STATUS_PASSED if ends.exit_code == 0 else common_pb2.VERDICT_STATUS_FAILED
        verdict = common_pb2.Verdict(
            status=status, exit_code=ends.exit_code, stdout="mini: step 1\n", stderr=ends.stderr
        )
        return sandbox_pb2.SessionExecResponse(verdict=verdict, timed_out=ends.timed_out)

    async def ReadFile(self, request, timeout=None):  # noqa: N802
        content = self.answers.get(request.session_id)
        if content is None:
            raise NotFound()
        return sandbox_pb2.ReadFileResponse(
            content=content[: request.max_bytes], size=len(content), truncated=len(content) > request.max_bytes
        )

    async def CloseSession(self, request, timeout=None):  # noqa: N802
        return sandbox_pb2.CloseSessionResponse()


class FakeEndpoint:
    """POST /v1/sessions, the trajectory read (an opened session nothing was recorded in has an empty
    document, as the endpoint's; every read a 404 when the endpoint `lost` its sessions), DELETE."""

    def __init__(self, lost: bool = False) -> None:
        self.called: set[str] = set()
        self.opened = 0
        self.lost = lost
        self.sampling: list[str | None] = []  # each POST /v1/sessions' X-Dockyard-Sampling header

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/sessions":
            self.sampling.append(request.headers.get(SAMPLING_HEADER))
            self.opened += 1
            session = f"s{self.opened}"
            return httpx.Response(200, json={"session_id": session, "api_key": f"dys-{session}-sig"})
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": path.rsplit("/", 1)[-1]})
        session = path.split("/")[3]
        if self.lost:
            return httpx.Response(404, json={"type": "error", "error": {"message": f"no session {session!r}"}})
        segments = []
        if session in self.called:
            segments.append(
                {
                    "reason": "start",
                    "messages": [],
                    "tools": None,
                    "token_ids": [1, 2, 3, 4, 5],
                    "loss_mask": [0, 0, 0, 1, 1],
                    "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25],
                    "weight_versions": [-1, -1, -1, 0, 0],
                    "turns": [],
                }
            )
        document = {
            "schema_version": 1,
            "session_id": session,
            "invalid_actions": 0,
            "status": "ok",
            "error": "",
            "turns": len(segments),
            "splits": {},
            "segments": segments,
        }
        return httpx.Response(200, json=document)


async def passed(task, answer, request_id):
    return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_PASSED, tests_passed=1, tests_total=1)


def setup(ends, *overrides: str, lost: bool = False):
    base = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "logger.num_samples_per_step=0"]
    config = load_config(CONFIG, base + list(overrides))
    endpoint = FakeEndpoint(lost)
    sandbox = FakeSandbox(endpoint, ends)
    fleet = Fleet(60.0, channel_factory=lambda kind, address, mb: (None, sandbox))
    fleet.register("sandbox", "sandbox", "127.0.0.1:1")
    trials = AgentTrials(
        "job",
        config,
        fleet,
        passed,
        sandbox_pb2.Limits(timeout_seconds=10),
        endpoint_address="127.0.0.1:9",
        token="token",
        max_regenerations=2,
        wait_timeout=5.0,
        transport=httpx.MockTransport(endpoint.handle),
    )
    return config, trials, fleet


def collector_of(config, trials: AgentTrials, fleet: Fleet) -> Collector:
    collector = Collector(
        "job",
        config,
        fleet,
        SimpleNamespace(put=put, data_plane=None),  # no data plane: the trials' arrays come here
        routing=SimpleNamespace(required_version=0),
        max_generations=1,
        max_scoring=1,
        generate_timeout=10.0,
    )
    collector.agent = trials
    return collector


async def put(group, staged=None):
    return SimpleNamespace(duplicate=False, dropped_stale=False)


FAILURES = {
    "exit 3 before its first call": (CRASH, "exited with status 3", "ImportError"),
    "killed at the time limit": (
        Ends(timed_out=True, exit_code=-9, stderr="still thinking"),
        "killed at the trial's time limit",
        "still thinking",
    ),
    "garbage in its answer file": (
        Ends(answer=b"\xff\xfe\x00\x01 binary", stderr="wrote answer"),
        "garbage output: its answer file answer.txt is not UTF-8 text",
        "wrote answer",
    ),
    "exit 0 without a model call": (
        Ends(calls_model=False, stderr="config error, giving up"),
        "made no model call",
        "config error",
    ),
}


@pytest.mark.parametrize("case", list(FAILURES))
async def test_each_kind_of_scaffold_failure_is_a_masked_trial_with_its_stderr_tail(case) -> None:
    ends, error, stderr = FAILURES[case]
    config, trials, _ = setup([ends], "env.scaffold.answer_file=answer.txt")
    task = load_tasks(config, "train")[0]
    try:
        [trial] = await trials.group(task, "job/g0", 0, 1, config.policy.generation)
    finally:
        await trials.close()
    t = trial.trajectory
    assert not t.valid and is_scaffold_error(t)
    assert not t.prompt_token_ids and not t.completion_token_ids and not t.later_segments  # nothing to train
    assert t.verdict.status == common_pb2.VERDICT_STATUS_ERROR
    assert t.verdict.error_message.startswith(f"{SCAFFOLD_ERROR_PREFIX}{PACKAGE}: {error}"), t.verdict.error_message
    assert trial.scaffold_error.startswith(error) and stderr in trial.output_tail
    assert trials.scaffold_errors.total == 1 and trials.regenerated_groups == 0


async def test_a_session_the_endpoint_lost_is_a_lost_trial_not_a_scaffold_error() -> None:
    config, trials, _ = setup([CRASH], "env.scaffold.answer_file=answer.txt", lost=True)
    task = load_tasks(config, "train")[0]
    try:
        with pytest.raises(TrialLost, match="404"):
            await trials.group(task, "job/g0", 0, 1, config.policy.generation)
    finally:
        await trials.close()
    # Generated again (and lost again) as a replica's failure would be; never counted against the scaffold.
    assert trials.regenerated_groups > 0 and trials.scaffold_errors.total == 0


async def test_a_scaffold_that_ran_and_called_the_model_is_a_scored_trial() -> None:
    config, trials, _ = setup([Ends(answer=b"f(x)=x+1")], "env.scaffold.answer_file=answer.txt")
    task = load_tasks(config, "train")[0]
    try:
        [trial] = await trials.group(task, "job/g0", 0, 1, config.policy.generation)
    finally:
        await trials.close()
    t = trial.trajectory
    assert not is_scaffold_error(t) and t.verdict.status == common_pb2.VERDICT_STATUS_PASSED
    assert list(t.completion_loss_mask) == [1, 1] and t.completion_text == "f(x)=x+1"
    assert trials.scaffold_errors.total == 0 and trial.scaffold_error == ""


async def test_a_validation_trial_opens_a_greedy_session_and_a_training_trial_does_not() -> None:
    """The scaffold holds only its key: the coordinator fixes the session's law when it opens it."""
    config, trials, fleet = setup([Ends(answer=b"x+1")], "env.scaffold.answer_file=answer.txt")
    endpoint = fleet.members("sandbox")[0].stub.endpoint
    task = load_tasks(config, "train")[0]
    greedy = config.policy.generation.model_copy(update={"temperature": 0.0})
    try:
        await trials.group(task, "job/g0", 0, 1, config.policy.generation)
        await trials.validation_trial(task, "job/val/0", greedy)
    finally:
        await trials.close()
    assert endpoint.sampling == [None, SAMPLING_GREEDY]


async def test_the_output_tail_is_the_end_of_stderr_and_stdout_stands_in_when_stderr_is_empty() -> None:
    long = "".join(f"line {i}\n" for i in range(2000))
    config, trials, _ = setup([Ends(exit_code=1, stderr=long), Ends(exit_code=1, stderr="")])
    task = load_tasks(config, "train")[0]
    try:
        first = await trials.trial(task, "job/g0/0", 0, config.policy.generation)
        second = await trials.trial(task, "job/g0/1", 1, config.policy.generation)
    finally:
        await trials.close()
    assert first.output_tail == long[-TAIL_CHARS:] and first.output_tail.endswith("line 1999\n")
    assert second.output_tail == "mini: step 1\n"


async def test_scaffold_errors_are_masked_not_regenerated_and_reach_samples_and_metrics(tmp_path: Path) -> None:
    # Two of four trials crash before calling the model; the other two ran.
    config, trials, fleet = setup([CRASH, OK, CRASH, OK])
    collector = collector_of(config, trials, fleet)
    task = load_tasks(config, "train")[0]
    try:
        group = await collector.make_group(task, "job/s1/g0", 7)
    finally:
        await trials.close()
    assert collector.counters().regenerated_groups == 0
    assert sorted(t.valid for t in group.trajectories) == [False, False, True, True]
    assert sum(is_scaffold_error(t) for t in group.trajectories) == 2
    stats = CollectStats()
    assert await collector.deliver(group, stats)
    rows = collector.samples.take()
    assert [r["verdict"] for r in rows] == ["scaffold_error", "scaffold_error"]
    assert all("ImportError: no module named litellm" in r["scaffold_output"] for r in rows)
    assert all(r["error"].startswith(f"{SCAFFOLD_ERROR_PREFIX}{PACKAGE}: exited with status 3") for r in rows)
    folder = RunFolder(tmp_path)
    folder.record_samples(1, rows)
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all("ImportError" in r["scaffold_output"] for r in written)
    step_metrics = StepMetrics(fleet, collector, SimpleNamespace(), folder)
    metrics = step_metrics.fleet(1)
    assert metrics["scaffold_errors"] == 2.0
    assert "scaffold errors 2" in "\n".join(fleet_summary(metrics))
    assert step_metrics.fleet(2)["scaffold_errors"] == 0.0  # per step: nothing new since the last


async def test_a_group_of_only_scaffold_errors_is_counted_as_failed_at_once() -> None:
    config, trials, fleet = setup([CRASH])
    collector = collector_of(config, trials, fleet)
    task = load_tasks(config, "train")[0]
    try:
        with pytest.raises(GroupUnscorable) as raised:
            await collector.make_group(task, "job/s1/g0", 7)
    finally:
        await trials.close()
    assert "4 of 4 were scaffold errors" in str(raised.value) and "exited with status 3" in raised.value.first
    assert collector.counters().regenerated_groups == 0 and collector.counters().scaffold_errors == 4
    assert len(collector.samples.take()) == 4


def test_the_rule_fails_only_above_the_fraction_of_a_step_of_trials() -> None:
    errors = ScaffoldErrors(PACKAGE, 0.5, window=8)
    errors.count(["exited with status 3"] * 4 + [""] * 4)  # 4 of 8: not more than half
    errors.count([""] * 4 + ["exited with status 3"] * 4)  # a new window: 4 of 8 again
    with pytest.raises(ScaffoldFailing) as raised:
        errors.count(["exited with status 3"] * 4 + ["killed at the trial's time limit (120 s)"])
    message = str(raised.value)
    assert PACKAGE in message and "5 of the last 5" in message and "killed at the trial's time limit" in message
    assert errors.total == 13 and errors.trials == 21
    never = ScaffoldErrors(PACKAGE, 1.0, window=8)
    never.count(["exited with status 3"] * 64)
    assert never.total == 64


def crashing(first_task_files, also_first_of_the_other: bool = False):
    """The first task's trials crash; with `also_first_of_the_other`, so does the other task's first trial."""
    others = []

    def ends(request, i) -> Ends:
        if dict(request.files) == first_task_files:
            return CRASH
        others.append(request.request_id)
        return CRASH if also_first_of_the_other and len(others) == 1 else OK

    return ends


async def test_a_step_below_the_fraction_goes_on_and_one_above_it_fails_the_job_naming_the_scaffold() -> None:
    # A step of two groups of four: the first task's trials all crash (4 of 8: not more than 0.5).
    config, trials, fleet = setup(OK)
    tasks = load_tasks(config, "train")
    first = dict(next(TaskStream(tasks, 0)).files)
    config, trials, fleet = setup(crashing(first))
    collector = collector_of(config, trials, fleet)
    producer = SyncProducer(collector, TaskStream(tasks, 0), GroupIds("job", 0), config.grpo)
    try:
        stats = await producer.collect_step(1)
    finally:
        await trials.close()
    assert stats.groups == 1 and stats.failed == 1 and stats.trajectories == 4
    assert collector.counters().scaffold_errors == 4

    # One more crash (5 of 8) fails the step, and so the job, with the scaffold and its last error.
    config, trials, fleet = setup(crashing(first, also_first_of_the_other=True))
    collector = collector_of(config, trials, fleet)
    producer = SyncProducer(collector, TaskStream(tasks, 0), GroupIds("job", 0), config.grpo)
    try:
        with pytest.raises(ScaffoldFailing) as raised:
            await producer.collect_step(1)
    finally:
        await trials.close()
    message = str(raised.value)
    assert f"the scaffold {PACKAGE} failed in 5 of the last" in message and "max_error_fraction=0.5" in message
    assert "exited with status 3" in message and "ImportError: no module named litellm" in message
