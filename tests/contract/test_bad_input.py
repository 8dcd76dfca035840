"""Bad input on every RPC of the five services, each a real server process.

    case ──RPC (with a deadline)──> service ──> status code + message ──> tally[service, code]
                                       └──> Health.Check: still SERVING

Every case names the status codes it accepts and the words its message must
hold (the field at fault). UNKNOWN, INTERNAL and a missed deadline are never
accepted. Every method of every service also gets bytes that do not parse
(invalid UTF-8 in a string, nesting past protobuf's recursion limit, a
truncated field): INVALID_ARGUMENT naming the method. The counts of inputs
tried and their outcomes are printed at the end of the module (`pytest -s`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dockyard.api.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from dockyard.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from dockyard.config import load_config_text
from dockyard.rpc.client import connect
from services.coordinator.jobs import JobRecord
from tests.conftest import dead_address, make_group

DEADLINE = 60.0
INVALID, NOT_FOUND, PRECONDITION = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
)
HUGE = 2**63 - 1
MEGABYTE_ID = "x" * (1 << 20)
# 254 bytes of YAML that expand to 9^7 values.
ALIAS_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdef", "bcdefg", strict=True)
)
MODEL = """
policy:
  model: {model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
          num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 256}
  train_global_batch_size: 4
  generation: {max_new_tokens: 4}
grpo: {num_prompts_per_step: 1, num_generations_per_prompt: 4, max_trajectory_age_steps: 0}
logger: {log_dir: LOG_DIR}
"""
TALLY: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def print_tally() -> Iterator[None]:
    yield
    services = sorted({service for service, _ in TALLY})
    print(f"\nbad-input suite: {sum(TALLY.values())} inputs tried")
    for service in services:
        outcomes = {code: n for (s, code), n in sorted(TALLY.items()) if s == service}
        print(f"  {service:12} {sum(outcomes.values()):4}  " + "  ".join(f"{c}={n}" for c, n in outcomes.items()))
    totals = Counter()
    for (_, code), n in TALLY.items():
        totals[code] += n
    print("  outcomes     " + "  ".join(f"{c}={n}" for c, n in sorted(totals.items())))


class Prober:
    """Sends one bad input at a time and checks the answer and the service's health after it."""

    def __init__(self, service: str, channel: grpc.aio.Channel) -> None:
        self.service = service
        self.channel = channel
        self.health = health_pb2_grpc.HealthStub(channel)

    async def expect(self, call: Awaitable, codes: grpc.StatusCode | tuple, *words: str) -> str:
        codes = codes if isinstance(codes, tuple) else (codes,)
        try:
            await call
            code, details = "OK", ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        TALLY[(self.service, code)] += 1
        assert code not in ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"), details
        assert code in [c.name for c in codes], f"{code}: {details[:500]}"
        for word in words:
            assert word in details, f"{word!r} not in {details[:500]!r}"
        assert len(details) < 4096, "an error message must stay far below the metadata limit"
        reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return details

    async def undecodable(self, service_descriptor) -> None:
        """Every method: bytes that do not parse are INVALID_ARGUMENT naming the method."""
        for method in service_descriptor.methods:
            path = f"/{service_descriptor.full_name}/{method.name}"
            call = self.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            for data in _undecodable(method.input_type):
                await self.expect(call(data, timeout=DEADLINE), INVALID, method.name, "does not parse")


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _undecodable(message) -> list[bytes]:
    """A truncated field, unknown groups nested 300 deep, and invalid UTF-8 in the first string field."""
    cases = [_varint(1 << 3 | 2) + b"\x05ab", _varint(999 << 3 | 3) * 300 + _varint(999 << 3 | 4) * 300]
    strings = [f for f in message.fields if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING]
    if strings:
        cases.append(_varint(strings[0].number << 3 | 2) + b"\x02\xff\xfe")
    return cases


def _descriptor(module, name: str):
    return module.DESCRIPTOR.services_by_name[name]


# -- coordinator ---------------------------------------------------------------


@pytest.fixture
def coordinator(start_service):
    dead = dead_address()
    env = {f"DOCKYARD_COORDINATOR_{peer}_ADDRESS": dead for peer in ("TRAINER", "BUFFER")}
    env["DOCKYARD_COORDINATOR_FLEET_WAIT_TIMEOUT_SECONDS"] = "1"
    env["DOCKYARD_COORDINATOR_MEMBER_TIMEOUT_SECONDS"] = "60"
    return start_service("coordinator", env)


async def test_coordinator_refuses_bad_input(coordinator, tmp_path: Path) -> None:
    config = MODEL.replace("LOG_DIR", str(tmp_path))
    async with connect(coordinator.address, default_timeout=DEADLINE) as channel:
        stub, probe = coordinator_pb2_grpc.CoordinatorServiceStub(channel), Prober("coordinator", channel)
        await probe.undecodable(_descriptor(coordinator_pb2, "CoordinatorService"))

        def create(yaml: str, job_id: str = ""):
            return stub.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=yaml, job_id=job_id))

        await probe.expect(create(""), INVALID, "config_yaml")
        await probe.expect(create(ALIAS_BOMB), INVALID, "expands")
        await probe.expect(create("a: &a [*a]\n"), INVALID, "alias")
        await probe.expect(create("x: " + "[" * 5000 + "]" * 5000), INVALID, "nested")
        await probe.expect(create(config + "#" * (1 << 20)), INVALID, "bytes")
        await probe.expect(create(config + "grpo: {max_num_steps: 9223372036854775808}"), INVALID, "max_num_steps")
        await probe.expect(create(config.replace("max_trajectory_age_steps: 0", "max_num_steps: 1000000000")),
                           INVALID, "grpo.max_num_steps")  # fmt: skip
        await probe.expect(create(config.replace("max_new_tokens: 4", "temperature: .nan")), INVALID, "temperature")
        await probe.expect(create(config, "../escape"), INVALID, "job_id")
        await probe.expect(create(config, MEGABYTE_ID), INVALID, "job_id")

        by_id = {
            "GetJob": lambda job_id: stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id)),
            "CancelJob": lambda job_id: stub.CancelJob(coordinator_pb2.CancelJobRequest(job_id=job_id)),
            "GetWeightSyncGroup": lambda job_id: stub.GetWeightSyncGroup(
                coordinator_pb2.GetWeightSyncGroupRequest(job_id=job_id, member="trainer")
            ),
            "LeaveWeightSyncGroup": lambda job_id: stub.LeaveWeightSyncGroup(
                coordinator_pb2.LeaveWeightSyncGroupRequest(job_id=job_id, member="rollout")
            ),
        }
        for call in by_id.values():
            await probe.expect(call(""), INVALID, "job_id")
            await probe.expect(call("../../etc"), INVALID, "job_id")
            details = await probe.expect(call(MEGABYTE_ID), INVALID, "job_id")
            assert "characters left out" in details or len(details) < 300
            await probe.expect(call("no-such-job"), NOT_FOUND, "no-such-job")

        rollout = coordinator_pb2.MEMBER_KIND_ROLLOUT

        def register(name: str, address: str, kind=rollout):
            return stub.RegisterMember(coordinator_pb2.RegisterMemberRequest(kind=kind, name=name, address=address))

        await probe.expect(register("rollout-a", "h:" + "1" * (1 << 20)), INVALID, "address")
        await probe.expect(register("rollout-a", "not an address"), INVALID, "address")
        await probe.expect(register("rollout-a", "127.0.0.1:1", kind=0), INVALID, "kind")
        await probe.expect(register("../a", "127.0.0.1:1"), INVALID, "name")
        await probe.expect(register("rollout-a", "127.0.0.1:1"), grpc.StatusCode.OK)
        await probe.expect(register("rollout-a", "127.0.0.1:1"), grpc.StatusCode.OK)  # the same member again
        await probe.expect(register("rollout-a", "10.9.9.9:2"), PRECONDITION, "held by a live member")
        members = (await stub.ListMembers(coordinator_pb2.ListMembersRequest())).members
        assert [(m.name, m.address) for m in members] == [("rollout-a", "127.0.0.1:1")]

        heartbeat = stub.Heartbeat
        await probe.expect(heartbeat(coordinator_pb2.HeartbeatRequest()), INVALID, "name")
        await probe.expect(heartbeat(coordinator_pb2.HeartbeatRequest(name="rollout-a", load=-1)), INVALID, "load")
        await probe.expect(heartbeat(coordinator_pb2.HeartbeatRequest(name="rollout-zz")), NOT_FOUND, "rollout-zz")
        unregister = stub.UnregisterMember
        await probe.expect(unregister(coordinator_pb2.UnregisterMemberRequest()), INVALID, "name")
        await probe.expect(unregister(coordinator_pb2.UnregisterMemberRequest(name="rollout-zz")), NOT_FOUND)
        await probe.expect(stub.ListJobs(coordinator_pb2.ListJobsRequest()), grpc.StatusCode.OK)
        assert not (await stub.ListJobs(coordinator_pb2.ListJobsRequest())).jobs  # nothing bad was created


def _stored(state_dir: Path, job_id: str, **changes) -> None:
    config = MODEL.replace("LOG_DIR", str(state_dir))
    record = JobRecord(job_id=job_id, config=load_config_text(config), config_yaml=config, run_dir=str(state_dir))
    document = record.to_document() | changes
    (state_dir / job_id).mkdir(parents=True)
    (state_dir / job_id / "job.json").write_text(json.dumps(document))


async def test_a_stored_job_that_no_longer_fits_never_breaks_listing(start_service, tmp_path: Path) -> None:
    state_dir = tmp_path / "coordinator-state"
    _stored(state_dir, "steps-beyond-int64", config_yaml=MODEL + "grpo: {max_num_steps: 9223372036854775808}\n")
    _stored(state_dir, "step-beyond-int64", step=2**64, state="SUCCEEDED")
    _stored(state_dir, "not-an-object")
    (state_dir / "not-an-object" / "job.json").write_text("[1, 2]")
    _stored(state_dir, "fine", state="SUCCEEDED")
    coordinator = start_service("coordinator")
    async with connect(coordinator.address, default_timeout=DEADLINE) as channel:
        stub, probe = coordinator_pb2_grpc.CoordinatorServiceStub(channel), Prober("coordinator", channel)
        await probe.expect(stub.ListJobs(coordinator_pb2.ListJobsRequest()), grpc.StatusCode.OK)
        jobs = (await stub.ListJobs(coordinator_pb2.ListJobsRequest())).jobs
        assert [j.job_id for j in jobs] == ["fine"]
        await probe.expect(stub.GetJob(coordinator_pb2.GetJobRequest(job_id="fine")), grpc.StatusCode.OK)
        for job_id in ("steps-beyond-int64", "step-beyond-int64"):
            await probe.expect(stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id)), NOT_FOUND, job_id)
    assert coordinator.stop() == 0
    assert coordinator.logs().count("stored job left out") == 2
    assert "unreadable job document left out" in coordinator.logs()


# -- buffer --------------------------------------------------------------------


def _group(group_id: str, **trajectory) -> common_pb2.Group:
    group = make_group(group_id)
    for name, value in trajectory.items():
        if isinstance(value, list):
            getattr(group.trajectories[0], name)[:] = value
        else:
            setattr(group.trajectories[0], name, value)
    return group


async def test_buffer_refuses_bad_input_and_keeps_what_it_accepted(start_service) -> None:
    buffer = start_service("buffer", {"DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS": "4096"})
    job = "job-1"
    async with connect(buffer.address, default_timeout=DEADLINE) as channel:
        stub, probe = buffer_pb2_grpc.BufferServiceStub(channel), Prober("buffer", channel)
        await probe.undecodable(_descriptor(buffer_pb2, "BufferService"))

        open_job = stub.OpenJob
        await probe.expect(open_job(buffer_pb2.OpenJobRequest(job_id="../x", max_groups=4)), INVALID, "job_id")
        await probe.expect(open_job(buffer_pb2.OpenJobRequest(job_id=MEGABYTE_ID, max_groups=4)), INVALID, "job_id")
        await probe.expect(open_job(buffer_pb2.OpenJobRequest(job_id=job)), INVALID, "max_groups")
        rewind = buffer_pb2.OpenJobRequest(job_id=job, max_groups=4, rewind_to_version=HUGE)
        await probe.expect(open_job(rewind), INVALID, "rewind_to_version")
        age = "max_trajectory_age_steps"
        for fields, word in [({"max_groups": 2**31 - 1}, "max_groups"), ({age: 2**31 - 1}, age), ({age: -1}, age)]:
            request = buffer_pb2.OpenJobRequest(**{"job_id": job, "max_groups": 4, **fields})
            await probe.expect(open_job(request), INVALID, word, "[")
        await stub.OpenJob(buffer_pb2.OpenJobRequest(job_id=job, max_groups=16, max_trajectory_age_steps=1))
        await stub.PutGroup(buffer_pb2.PutGroupRequest(group=make_group("good-0")))

        def put(group: common_pb2.Group):
            return stub.PutGroup(buffer_pb2.PutGroupRequest(group=group))

        nan, inf = float("nan"), float("inf")
        await probe.expect(stub.PutGroup(buffer_pb2.PutGroupRequest()), INVALID, "group")
        bad_groups = {
            "reward": _group("g-nan-reward", reward=nan),
            "reward ": _group("g-inf-reward", reward=-inf),
            "completion_logprobs": _group("g-nan-logprob", completion_logprobs=[-0.1, nan, -0.1]),
            "completion_logprobs ": _group("g-inf-logprob", completion_logprobs=[-inf, -0.1, -0.1]),
            " completion_logprobs": _group("g-positive-logprob", completion_logprobs=[-0.1, 0.5, -0.1]),
            "completion_token_ids": _group("g-negative-id", completion_token_ids=[3, -4, 5]),
            "prompt_token_ids": _group("g-empty-prompt", prompt_token_ids=[]),
            " completion_token_ids": _group("g-mismatch", completion_logprobs=[-0.1]),
            "DOCKYARD_BUFFER_MAX_TRAJECTORY_TOKENS": _group(
                "g-huge", completion_token_ids=[3] * 5000, completion_logprobs=[-0.1] * 5000
            ),
        }
        for word, group in bad_groups.items():
            await probe.expect(put(group), INVALID, group.group_id, word.strip())
        bad_job = make_group("g-bad-job", job_id="../x")
        await probe.expect(put(bad_job), INVALID, "group.job_id")
        future = make_group("g-future", version=HUGE)
        await probe.expect(put(future), INVALID, "weight_version")
        await stub.PutGroup(buffer_pb2.PutGroupRequest(group=make_group("good-1")))

        lease = {"job_id": job, "consumer": "t0", "max_groups": 8}
        sample = stub.SampleGroups
        for step, code, word in [(HUGE, INVALID, "trainer_step"), (-1, INVALID, "trainer_step"),
                                 (5, PRECONDITION, "beyond its clock")]:  # fmt: skip
            await probe.expect(sample(buffer_pb2.SampleGroupsRequest(**lease, trainer_step=step)), code, word)
            reclaim = buffer_pb2.ReclaimGroupsRequest(**lease, trainer_step=step)
            await probe.expect(stub.ReclaimGroups(reclaim), code, word)
        await probe.expect(sample(buffer_pb2.SampleGroupsRequest(**{**lease, "consumer": ""})), INVALID, "consumer")
        long_lease = buffer_pb2.SampleGroupsRequest(**lease, trainer_step=0, lease_id="x" * 2**20)
        await probe.expect(sample(long_lease), INVALID, "lease_id", "320")
        for stranger in ("", "t0/" + "0" * 32):  # a sample that would move the clock, without the trainer lease
            ahead = buffer_pb2.SampleGroupsRequest(**lease, trainer_step=1, lease_id=stranger)
            await probe.expect(sample(ahead), PRECONDITION, "trainer lease", job)
            await probe.expect(
                stub.ReclaimGroups(buffer_pb2.ReclaimGroupsRequest(**lease, trainer_step=1, lease_id=stranger)),
                PRECONDITION,
                "trainer lease",
            )
        await probe.expect(sample(buffer_pb2.SampleGroupsRequest(**{**lease, "max_groups": 0})), INVALID, "max_groups")
        idle = buffer_pb2.ReclaimGroupsRequest(**lease, min_idle_seconds=float("nan"))
        await probe.expect(stub.ReclaimGroups(idle), INVALID, "min_idle_seconds")
        await _buffer_stream_cases(stub, probe, buffer.address, job, lease)
        take = stub.TakeTrainerLease
        await probe.expect(take(buffer_pb2.TakeTrainerLeaseRequest(job_id="../x", consumer="t0")), INVALID, "job_id")
        await probe.expect(take(buffer_pb2.TakeTrainerLeaseRequest(job_id=job)), INVALID, "consumer")
        huge_name = buffer_pb2.TakeTrainerLeaseRequest(job_id=job, consumer="t" * 2**20)
        await probe.expect(take(huge_name), INVALID, "consumer", "256")
        await probe.expect(take(buffer_pb2.TakeTrainerLeaseRequest(job_id="other", consumer="t0")), NOT_FOUND, "other")
        owner = (await take(buffer_pb2.TakeTrainerLeaseRequest(job_id=job, consumer="t0"))).lease_id
        ack = stub.AckGroups

        def acking(**fields) -> buffer_pb2.AckGroupsRequest:
            return buffer_pb2.AckGroupsRequest(**{"job_id": job, "lease_id": owner, **fields})

        # The lease: too long, none, a guess, a predecessor's; the clock move the issue found, without the lease.
        await probe.expect(ack(acking(lease_id="x" * 2**20)), INVALID, "lease_id", "320")
        for stranger in ("", "t0/" + "0" * 32, owner + "0", owner.upper()):
            await probe.expect(ack(acking(lease_id=stranger, group_ids=["good-0"])), PRECONDITION, "trainer lease", job)
        for ahead in (3, 995):
            await probe.expect(ack(acking(lease_id="", weight_version=ahead)), PRECONDITION, "trainer lease", job)
        await probe.expect(ack(acking(weight_version=HUGE)), INVALID, "weight_version")
        for ahead in (1, 3, 995):  # a clock move without groups: refused, the running job undisturbed
            await probe.expect(ack(acking(group_ids=[], weight_version=ahead)), PRECONDITION, "no group_ids", "clock")
        await probe.expect(ack(acking(weight_version=0)), grpc.StatusCode.OK)
        await probe.expect(ack(acking(group_ids=["good-0"], weight_version=7)), PRECONDITION, "beyond its clock")
        await probe.expect(ack(acking(group_ids=[""])), INVALID, "group_ids[0]")
        await probe.expect(ack(acking(group_ids=["ghost"])), NOT_FOUND, "ghost")
        for bad in ("", "../x"):
            await probe.expect(stub.GetStats(buffer_pb2.GetStatsRequest(job_id=bad)), INVALID, "job_id")
            await probe.expect(stub.CloseJob(buffer_pb2.CloseJobRequest(job_id=bad)), INVALID, "job_id")
        await probe.expect(stub.GetStats(buffer_pb2.GetStatsRequest(job_id="other")), NOT_FOUND, "other")

        # Nothing accepted was lost, nothing refused was kept, and the clock still works.
        stats = await stub.GetStats(buffer_pb2.GetStatsRequest(job_id=job))
        assert (stats.held, stats.puts, stats.latest_version) == (2, 2, 0)
        reply = await stub.SampleGroups(buffer_pb2.SampleGroupsRequest(**lease, trainer_step=0))
        assert sorted(g.group_id for g in reply.groups) == ["good-0", "good-1"]
        acked = await stub.AckGroups(acking(group_ids=["good-0", "good-1"], weight_version=1))
        assert acked.acked == 2
        assert (await stub.AckGroups(acking(group_ids=["good-0", "good-1"], weight_version=1))).acked == 0  # no-op
        await probe.expect(ack(acking(group_ids=["good-0"], weight_version=2)), PRECONDITION, "acks no leased group")
        assert (await stub.GetStats(buffer_pb2.GetStatsRequest(job_id=job))).latest_version == 1


async def _buffer_stream_cases(stub, probe: Prober, address: str, job: str, lease: dict) -> None:
    """The streamed RPCs: a put far over the group limit (refused while streaming, the status reaching the
    client, not a broken write), lease requests with bad fields, GetDataPlane."""

    async def drained(call) -> None:
        async for _ in call:
            pass

    def oversized():
        yield buffer_pb2.PutGroupStreamRequest(group=make_group("g-100mb"), payload=b"x" * (1 << 20))
        for _ in range(99):
            yield buffer_pb2.PutGroupStreamRequest(payload=b"x" * (1 << 20))

    # A plain channel, as an outside client has: on it a status sent while the client still writes came
    # back as INTERNAL ("Internal error from Core") from the second try on; the buffer now reads the rest first.
    async with grpc.aio.insecure_channel(address) as plain:
        raw, plain_probe = buffer_pb2_grpc.BufferServiceStub(plain), Prober("buffer", plain)
        for _ in range(4):
            await plain_probe.expect(raw.PutGroupStream(oversized()), INVALID, "g-100mb", "MAX_GROUP_MB")
    no_group = iter([buffer_pb2.PutGroupStreamRequest(payload=b"x")])
    await probe.expect(stub.PutGroupStream(no_group), INVALID, "first chunk")
    await probe.expect(stub.PutGroupStream(iter([])), INVALID, "group is missing")
    for name in ("SampleGroupsStream", "ReclaimGroupsStream"):
        request_type, call = getattr(buffer_pb2, f"{name}Request"), getattr(stub, name)
        for fields, word in [({"consumer": MEGABYTE_ID}, "consumer"), ({"consumer": ""}, "consumer"),
                             ({"max_groups": 0}, "max_groups"), ({"trainer_step": HUGE}, "trainer_step"),
                             ({"job_id": "../x"}, "job_id")]:  # fmt: skip
            await probe.expect(drained(call(request_type(**{**lease, **fields}))), INVALID, word)
        await probe.expect(drained(call(request_type(**lease, payload_by_reference=True))), PRECONDITION, "data plane")
    await probe.expect(stub.GetDataPlane(buffer_pb2.GetDataPlaneRequest()), grpc.StatusCode.OK)


# -- sandbox -------------------------------------------------------------------


async def test_sandbox_refuses_bad_input(start_service) -> None:
    sandbox = start_service(
        "sandbox", {"DOCKYARD_SANDBOX_MAX_TIMEOUT_SECONDS": "30", "DOCKYARD_SANDBOX_MAX_FILE_MB": "1"}
    )
    async with connect(sandbox.address, default_timeout=DEADLINE) as channel:
        stub, probe = sandbox_pb2_grpc.SandboxServiceStub(channel), Prober("sandbox", channel)
        await probe.undecodable(_descriptor(sandbox_pb2, "SandboxService"))

        def execute(files: dict[str, str], command: list[str], **limits):
            request = sandbox_pb2.ExecuteRequest(files=files, command=command, limits=sandbox_pb2.Limits(**limits))
            return stub.Execute(request)

        main = {"main.py": "print(1)"}
        await probe.expect(execute(main, ["python", "main\0.py"]), INVALID, "command[1]", "NUL")
        await probe.expect(execute({"a\0b": "x"}, ["python", "-c", "1"]), INVALID, "files", "NUL")
        deep = "/".join(["d"] * 2000) + "/f.py"
        await probe.expect(execute({deep: "x"}, ["python", "-c", "1"]), INVALID, "files", "parts")
        many = {f"f{i}.txt": "" for i in range(100_000)}
        await probe.expect(execute(many, ["python", "-c", "1"]), INVALID, "files", "100000")
        await probe.expect(execute(main, ["python"] + ["x"] * 5000), INVALID, "command")
        await probe.expect(execute(main, []), INVALID, "command")
        await probe.expect(execute({"../up.py": "x"}, ["python", "up.py"]), INVALID, "files")
        await probe.expect(execute({"/etc/x": "x"}, ["python", "x"]), INVALID, "files")
        for name, value in [("timeout_seconds", float("nan")), ("timeout_seconds", 1e9), ("memory_mb", -1),
                            ("cpu_seconds", float("inf")), ("max_output_bytes", 2**62)]:  # fmt: skip
            await probe.expect(execute(main, ["python", "main.py"], **{name: value}), INVALID, f"limits.{name}")

        def run_tests(tests: list[str], **limits):
            limits = sandbox_pb2.Limits(**limits)
            return stub.RunTests(sandbox_pb2.RunTestsRequest(program="x = 1", tests=tests, limits=limits))

        await probe.expect(run_tests(["assert x"] * 100_000), INVALID, "tests")
        await probe.expect(run_tests(["assert x"], timeout_seconds=-1), INVALID, "limits.timeout_seconds")
        score = stub.ScorePatch
        await probe.expect(score(sandbox_pb2.ScorePatchRequest()), INVALID, "task_set")
        await probe.expect(score(sandbox_pb2.ScorePatchRequest(task_set="../t", instance_id="i")), PRECONDITION)
        await probe.expect(stub.ListInstances(sandbox_pb2.ListInstancesRequest(task_set="../t")),
                           (PRECONDITION, NOT_FOUND, INVALID))  # fmt: skip
        await _sandbox_session_cases(stub, probe, deep)
        await _sandbox_reward_cases(stub, probe)
        # Still answers real work.
        reply = await stub.Execute(sandbox_pb2.ExecuteRequest(files=main, command=["python", "main.py"]))
        assert reply.verdict.stdout == "1\n"


async def _sandbox_reward_cases(stub, probe: Prober) -> None:
    """Reward: every part sized before anything runs; a reward beyond any float is an ERROR verdict."""
    arguments = {"task": {}, "completion": {"text": "x"}, "verdict": {}}

    def reward(source: str = "def f(t, c, v):\n    return 1.0\n", function: str = "f", input_json: str = ""):
        input_json = input_json or json.dumps(arguments)
        return stub.Reward(sandbox_pb2.RewardRequest(source=source, function=function, input_json=input_json))

    deep = '{"task": {}, "completion": ' + "[" * 100_000 + "]" * 100_000 + ', "verdict": {}}'
    await probe.expect(reward(input_json=deep), INVALID, "input_json", "nested")
    shallow_deep = '{"task": {}, "completion": ' + "[" * 500 + "]" * 500 + ', "verdict": {}}'
    await probe.expect(reward(input_json=shallow_deep), INVALID, "input_json", "nested")
    huge = json.dumps({**arguments, "completion": {"text": "x" * (9 << 20)}})
    await probe.expect(reward(input_json=huge), INVALID, "input_json", "characters")
    await probe.expect(reward(source="#" * (2 << 20)), INVALID, "source")
    await probe.expect(reward(function="f" * 5000), INVALID, "function")
    await probe.expect(reward(function="not a name"), INVALID, "function")
    await probe.expect(reward(input_json="[1]"), INVALID, "input_json")
    await probe.expect(reward(input_json="{"), INVALID, "input_json")
    for value in ("10**400", "float('nan')", "'a string'"):
        await probe.expect(reward(source=f"def f(t, c, v):\n    return {value}\n"), grpc.StatusCode.OK)
        reply = await reward(source=f"def f(t, c, v):\n    return {value}\n")
        assert reply.verdict.status == common_pb2.VERDICT_STATUS_ERROR, reply.verdict
        assert "reward function f" in reply.verdict.error_message


async def _sandbox_session_cases(stub, probe: Prober, deep: str) -> None:
    """OpenSession, SessionExec, ReadFile, WriteFile, CloseSession, ScoreSession, PrepareSessions,
    ReleaseSessions: ids, paths, sizes, timeouts."""
    sandbox = sandbox_pb2

    def open_(**fields):
        return stub.OpenSession(sandbox.OpenSessionRequest(**fields))

    for idle in (-1.0, float("nan"), 1e12):
        await probe.expect(open_(idle_timeout_seconds=idle), INVALID, "idle_timeout_seconds")

    def prepare(**fields):
        return stub.PrepareSessions(sandbox.PrepareSessionsRequest(**{"job_id": "j", **fields}))

    await probe.expect(prepare(job_id=""), INVALID, "job_id")
    await probe.expect(prepare(size=-1), INVALID, "size")
    await probe.expect(prepare(packages=["--index-url=http://x"]), INVALID, "packages")
    await probe.expect(prepare(limits=sandbox.Limits(memory_mb=-1)), INVALID, "memory_mb")
    await probe.expect(stub.ReleaseSessions(sandbox.ReleaseSessionsRequest()), INVALID, "job_id")
    await probe.expect(prepare(task_set="t"), PRECONDITION, "DOCKYARD_SANDBOX_TASK_ROOT")  # no task root here
    # The local backend keeps no session started ahead: it answers 0, and releasing is harmless.
    assert (await prepare(size=2)).warm == 0
    await stub.ReleaseSessions(sandbox.ReleaseSessionsRequest(job_id="j"))
    await probe.expect(open_(task_set="t"), INVALID, "instance_id")
    await probe.expect(open_(instance_id="i"), INVALID, "task_set")
    await probe.expect(open_(task_set="t", instance_id="i"), PRECONDITION, "DOCKYARD_SANDBOX_TASK_ROOT")
    await probe.expect(open_(files={"../up.txt": "x"}), INVALID, "files")
    await probe.expect(open_(limits=sandbox.Limits(memory_mb=-1)), INVALID, "limits.memory_mb")
    for address in ("h:" + "1" * (1 << 20), "x" * (1 << 20), "not an address", "host:99999"):
        await probe.expect(open_(endpoint_address=address), INVALID, "endpoint_address")
    session_id = (await stub.OpenSession(sandbox.OpenSessionRequest())).session_id

    def exec_(sid: str = session_id, **fields):
        return stub.SessionExec(sandbox.SessionExecRequest(session_id=sid, **fields))

    for sid in ("", MEGABYTE_ID, "bad id!", "a\0b"):
        await probe.expect(exec_(sid, shell="true"), INVALID, "session_id")
        await probe.expect(stub.CloseSession(sandbox.CloseSessionRequest(session_id=sid)), INVALID, "session_id")
        await probe.expect(stub.ScoreSession(sandbox.ScoreSessionRequest(session_id=sid)), INVALID, "session_id")
    await probe.expect(exec_("x" * 43, shell="true"), NOT_FOUND, "no such session")
    await probe.expect(exec_(), INVALID, "command and shell")
    await probe.expect(exec_(command=["true"], shell="true"), INVALID, "command and shell")
    await probe.expect(exec_(command=["tr\0ue"]), INVALID, "command[0]", "NUL")
    await probe.expect(exec_(command=["x"] * 5000), INVALID, "command")
    await probe.expect(exec_(shell="echo \0"), INVALID, "shell")
    await probe.expect(exec_(shell="x" * 200_000), INVALID, "shell")
    await probe.expect(exec_(shell="true", stdin=b"x" * (2 << 20)), INVALID, "stdin")
    for timeout in (-1.0, float("nan"), 31.0):
        await probe.expect(exec_(shell="true", timeout_seconds=timeout), INVALID, "timeout_seconds")

    def read(path: str, **fields):
        return stub.ReadFile(sandbox.ReadFileRequest(session_id=session_id, path=path, **fields))

    def write(path: str, content: bytes = b"x"):
        return stub.WriteFile(sandbox.WriteFileRequest(session_id=session_id, path=path, content=content))

    for path in ("", "../x", "/etc/passwd", "a/../../x", "a\0b", deep, ".", "x" * 5000):
        await probe.expect(read(path), INVALID, "path")
        await probe.expect(write(path), INVALID, "path")
    await probe.expect(read("x", max_bytes=-1), INVALID, "max_bytes")
    await probe.expect(read("x", max_bytes=HUGE), INVALID, "max_bytes")
    await probe.expect(read("absent.txt"), NOT_FOUND, "absent.txt")
    await probe.expect(write("big.bin", b"x" * (2 << 20)), INVALID, "content")
    await probe.expect(stub.ScoreSession(sandbox.ScoreSessionRequest(session_id=session_id)), PRECONDITION, "SWE")
    limits = sandbox.Limits(timeout_seconds=-1)
    request = sandbox.ScoreSessionRequest(session_id=session_id, limits=limits)
    await probe.expect(stub.ScoreSession(request), INVALID, "limits.timeout_seconds")
    await stub.CloseSession(sandbox.CloseSessionRequest(session_id=session_id))
    await probe.expect(exec_(shell="true"), NOT_FOUND, "no such session")
    await probe.expect(stub.CloseSession(sandbox.CloseSessionRequest(session_id=session_id)), NOT_FOUND)


# -- trainer -------------------------------------------------------------------


async def test_trainer_refuses_bad_input(start_service, tmp_path: Path) -> None:
    buffer = start_service("buffer")
    trainer = start_service("trainer", {"DOCKYARD_TRAINER_BUFFER_ADDRESS": buffer.address})
    config = MODEL.replace("LOG_DIR", str(tmp_path))
    async with connect(trainer.address, default_timeout=DEADLINE) as channel:
        stub, probe = trainer_pb2_grpc.TrainerServiceStub(channel), Prober("trainer", channel)
        await probe.undecodable(_descriptor(trainer_pb2, "TrainerService"))

        def load(job_id: str, yaml: str = config):
            return stub.LoadPolicy(trainer_pb2.LoadPolicyRequest(job_id=job_id, config_yaml=yaml))

        for bad in ("", "../../escape", "a/b", MEGABYTE_ID):
            await probe.expect(load(bad), INVALID, "job_id")
        await probe.expect(load("job", ALIAS_BOMB), INVALID, "expands")
        await probe.expect(load("job", "x: " + "[" * 5000 + "]" * 5000), INVALID, "nested")
        await probe.expect(load("job", config + "grpo: {max_num_steps: 9223372036854775808}"), INVALID, "max_num_steps")
        by_id = [
            lambda job_id: stub.TrainStep(trainer_pb2.TrainStepRequest(job_id=job_id, step=1)),
            lambda job_id: stub.SupervisedStep(trainer_pb2.SupervisedStepRequest(job_id=job_id, step=1)),
            lambda job_id: stub.PushWeights(trainer_pb2.PushWeightsRequest(job_id=job_id)),
            lambda job_id: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id=job_id)),
            lambda job_id: stub.UnloadPolicy(trainer_pb2.UnloadPolicyRequest(job_id=job_id)),
        ]
        for call in by_id:
            await probe.expect(call(""), INVALID, "job_id")
            await probe.expect(call("../x"), INVALID, "job_id")
            await probe.expect(call("no-such-job"), NOT_FOUND, "no-such-job")

        await stub.LoadPolicy(trainer_pb2.LoadPolicyRequest(job_id="job", config_yaml=config))
        save = stub.SaveCheckpoint
        for metrics, word in [({"pass_rate": float("nan")}, "pass_rate"), ({"loss": float("inf")}, "loss"),
                              ({f"m{i}": 0.0 for i in range(5000)}, "metrics"), ({"": 1.0}, "metrics")]:  # fmt: skip
            await probe.expect(save(trainer_pb2.SaveCheckpointRequest(job_id="job", metrics=metrics)), INVALID, word)
        demo = trainer_pb2.Demonstration(prompt="f(1)=", completion="2")
        supervised = stub.SupervisedStep
        many = trainer_pb2.SupervisedStepRequest(job_id="job", step=1, demonstrations=[demo] * 1_000_000)
        await probe.expect(supervised(many), INVALID, "demonstrations")
        empty = trainer_pb2.SupervisedStepRequest(job_id="job", step=1, demonstrations=[trainer_pb2.Demonstration()])
        await probe.expect(supervised(empty), INVALID, "demonstrations[0]")
        late = trainer_pb2.SupervisedStepRequest(job_id="job", step=HUGE, demonstrations=[demo])
        await probe.expect(supervised(late), PRECONDITION, "step")
        # Sized by length before any tokenizing: 256 positions take at most 256 * 64 characters.
        for chars in (16_385, 30 << 20):
            long = trainer_pb2.Demonstration(prompt="f(1)=", completion="2" * chars)
            request = trainer_pb2.SupervisedStepRequest(job_id="job", step=1, demonstrations=[demo, long])
            started = time.monotonic()
            await probe.expect(supervised(request), INVALID, "demonstrations[1]", "16384", "before tokenizing")
            assert time.monotonic() - started < 10, "refused by its length, not after tokenizing"
        await probe.expect(stub.TrainStep(trainer_pb2.TrainStepRequest(job_id="job", step=-5)), PRECONDITION, "step")
        assert not list(tmp_path.glob("job/checkpoints/*")), "a refused save wrote nothing"


# -- rollout -------------------------------------------------------------------


async def test_rollout_refuses_bad_input(start_service, tmp_path: Path) -> None:
    rollout = start_service("rollout", {"DOCKYARD_ROLLOUT_NUM_THREADS": "1"})
    config = MODEL.replace("LOG_DIR", str(tmp_path))
    async with connect(rollout.address, default_timeout=DEADLINE) as channel:
        stub, probe = rollout_pb2_grpc.RolloutServiceStub(channel), Prober("rollout", channel)
        await probe.undecodable(_descriptor(rollout_pb2, "RolloutService"))

        def load(job_id: str, yaml: str = config):
            return stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id=job_id, config_yaml=yaml))

        for bad in ("", "../../escape", MEGABYTE_ID):
            await probe.expect(load(bad), INVALID, "job_id")
        await probe.expect(load("job", ALIAS_BOMB), INVALID, "expands")
        await probe.expect(load("job", ""), INVALID, "config_yaml")

        def generate(prompt: str = "1+2=", job_id: str = "job", **fields):
            return stub.Generate(rollout_pb2.GenerateRequest(job_id=job_id, prompt=prompt, num_samples=1, **fields))

        await probe.expect(generate(job_id="../x"), INVALID, "job_id")
        await probe.expect(generate("x" * (30 << 20)), INVALID, "prompt", "bytes")
        await probe.expect(generate(""), INVALID, "prompt")
        await probe.expect(generate(job_id="no-such-job"), NOT_FOUND, "no-such-job")
        by_id = [
            lambda job_id: stub.GetEngineInfo(rollout_pb2.GetEngineInfoRequest(job_id=job_id)),
            lambda job_id: stub.UnloadPolicy(rollout_pb2.UnloadPolicyRequest(job_id=job_id)),
            lambda job_id: stub.ReceiveWeights(rollout_pb2.ReceiveWeightsRequest(job_id=job_id, weight_version=1)),
        ]
        for call in by_id:
            await probe.expect(call(""), INVALID, "job_id")
            await probe.expect(call("../x"), INVALID, "job_id")
            await probe.expect(call("no-such-job"), NOT_FOUND, "no-such-job")

        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="job", config_yaml=config))
        await probe.expect(generate("1" * 300), INVALID, "prompt", "context")
        sampling = common_pb2.SamplingParams
        bad_sampling = {
            "temperature": sampling(temperature=float("nan"), top_p=1, max_new_tokens=2),
            "top_p": sampling(temperature=1, top_p=float("inf"), max_new_tokens=2),
            "max_new_tokens": sampling(temperature=1, top_p=1, max_new_tokens=2**31 - 1),
            "a stop string is at most 256": sampling(temperature=1, top_p=1, max_new_tokens=2, stop=["x" * (1 << 20)]),
            "stop strings": sampling(temperature=1, top_p=1, max_new_tokens=2, stop=["x"] * 17),
        }
        for word, params in bad_sampling.items():
            await probe.expect(generate(sampling=params), INVALID, word)
        await probe.expect(stub.Generate(rollout_pb2.GenerateRequest(job_id="job", prompt="1", num_samples=0)),
                           INVALID, "num_samples")  # fmt: skip
        await probe.expect(generate(top_logprobs=21), INVALID, "top_logprobs", "[0, 20]")
        await probe.expect(generate(top_logprobs=-1), INVALID, "top_logprobs", "[0, 20]")
        receive = rollout_pb2.ReceiveWeightsRequest(job_id="job", weight_version=-1)
        await probe.expect(stub.ReceiveWeights(receive), INVALID, "weight_version")
        reply = await stub.Generate(rollout_pb2.GenerateRequest(job_id="job", prompt="1+2=", num_samples=2))
        assert len(reply.completions) == 2
