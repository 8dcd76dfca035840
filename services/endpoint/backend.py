"""The endpoint's view of the fleet, over gRPC only: running jobs, their tokenizers, replicas, Generate.

    model (= job id) ──Jobs.renderer──> GetJob ─> <run_dir>/config.yaml ─> load_tokenizer ─> Renderer (cached)
                                                                       └─> policy.tool_call_format ─> format
                                                                       └─> policy.generation (the sampling law)
                                                                       └─> policy.records_routing (routing)
    session ──pick──> ListMembers: ALIVE rollout replicas holding the job ──Router.route──> sticky, else least
        loaded (services/endpoint/routing.py; a new session may wait for admission)
    prompt ids ──complete──> RolloutService.Generate(prompt_token_ids, top_logprobs, return_routing) on that replica
        (a streamed reply: GenerateStream's messages, every streamed call to the replica on one
        GenerateMultiplexed stream, services/endpoint/multiplex.py; tokens passed on as they are sampled)
        ──replica fails the call──> left out; the call goes to another live replica (the session moves)

Guarantees: an unknown or finished job is UnknownModel (a 404); a replica that
fails a call (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL or any other
error but INVALID_ARGUMENT, or a replica that forgot the job) is left out for a
while and the call is sent to another live replica, once per replica (nothing
of a failed call was recorded, so a retry is safe); when no other replica is
left, or none holds the job, it is ReplicaLost (a 503 that ends a session
that already took a turn as an infrastructure error); a request
the replica refuses (INVALID_ARGUMENT: e.g. prompt plus max_tokens past the
context) is GenerateRefused (a 400) with the replica's message, and so is a
job whose tokenizer cannot be loaded or has no chat template. Tokenizers and
channels are cached per job and per address; the member list and a job's
state are read at most once a second, in the background once held (renewed.py:
no call waits for the coordinator then; a job that just finished may be served
for up to a second and one GetJob more; its replicas then refuse).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dockyard.agents.tool_formats import pick
from dockyard.api.common.v1 import common_pb2
from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.config import SamplingConfig, load_config_text
from dockyard.experience.payload import shape_of
from dockyard.experience.routing_layout import RoutingShape
from dockyard.images import ImageLimits
from dockyard.models.load import load_tokenizer
from dockyard.rpc.client import connect
from services.endpoint.multiplex import CallFailed, MultiplexedCalls
from services.endpoint.reasoning import enabled as reasoning_enabled
from services.endpoint.rendering import Renderer
from services.endpoint.renewed import Renewed
from services.endpoint.routing import AdmissionRefused, Replica, ReplicaState, Router
from services.endpoint.settings import EndpointSettings
from services.endpoint.streaming import TokenSink

LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
LOST_JOB = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


class UnknownModel(LookupError):
    pass


class ReplicaLost(RuntimeError):
    pass


class GenerateRefused(ValueError):
    pass


@dataclass
class JobModel:
    job_id: str
    renderer: Renderer
    parser: str  # the job's tool-call format (dockyard/agents/tool_formats), picked from policy.tool_call_format
    max_new_tokens: int
    images: ImageLimits = field(default_factory=ImageLimits)  # the job's multimodal gate
    # The job's policy.generation: every turn samples with its temperature/top_p/top_k (turns.turn_sampling).
    sampling: SamplingConfig | None = None
    # Whether the model writes a thinking block (policy.reasoning, services/endpoint/reasoning.py).
    reasoning: bool = False
    # Whether the job records its mixture-of-experts routing (policy.records_routing): every Generate asks for it.
    routing: bool = False


@dataclass(frozen=True)
class Prompted:
    """A prompt with images: the conversation's rendered text and the image files, for the rollout's gate."""

    text: str
    images: list[bytes]


@dataclass
class Generated:
    prompt_token_ids: list[int]
    completions: list[rollout_pb2.Completion]
    weight_version: int
    weight_versions: list[int]
    replica: str
    # With routing asked for (a mixture-of-experts policy's): every prompt position's expert ids, and their layout.
    prompt_routing: bytes = b""
    routing_shape: RoutingShape | None = None


def load_job_model(job_id: str, folder: Path) -> JobModel:
    """The job as its run folder's config.yaml describes it: tokenizer, tool-call format, sampling law."""
    cfg = load_config_text((folder / "config.yaml").read_text(), origin=str(folder / "config.yaml"))
    tokenizer = load_tokenizer(cfg.policy)
    return JobModel(
        job_id,
        Renderer(tokenizer),
        pick(cfg.policy.tool_call_format, tokenizer)[0],
        cfg.policy.generation.max_new_tokens,
        ImageLimits.from_generation(cfg.policy.generation),
        sampling=cfg.policy.generation,
        reasoning=reasoning_enabled(cfg.policy.reasoning, str(tokenizer.chat_template)),
        routing=cfg.policy.records_routing,
    )


class Backend:
    def __init__(
        self,
        coordinator_address: str,
        *,
        generate_timeout: float,
        run_root: str = "",
        router: Router | None = None,
    ) -> None:
        self._coordinator = connect(coordinator_address, service="coordinator")
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._coordinator)
        self._timeout = generate_timeout
        self._run_root = Path(run_root) if run_root else None
        self._models: dict[str, JobModel] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[str, MultiplexedCalls] = {}
        # The fleet's rollout members and each served job's state, read from the coordinator once a second.
        self._members = Renewed(self._rollout_members, 1.0)
        self._running: dict[str, Renewed[coordinator_pb2.Job]] = {}
        self.router = router or Router()

    @classmethod
    def from_settings(cls, settings: EndpointSettings) -> Backend:
        """The backend the endpoint's settings describe (its gRPC channels belong to the running event loop)."""
        return cls(
            settings.coordinator_address,
            generate_timeout=settings.generate_timeout_seconds,
            run_root=settings.run_root,
            router=Router(
                settings.admission_pressure,
                settings.admission_queue_size,
                settings.admission_wait_seconds,
                settings.admission_session_tokens,
            ),
        )

    async def close(self) -> None:
        for calls in self._streams.values():
            await calls.close()
        for channel in [self._coordinator, *self._channels.values()]:
            await channel.close()

    async def running_jobs(self) -> list[coordinator_pb2.Job]:
        reply = await self._stub.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10)
        return [j for j in reply.jobs if j.state == coordinator_pb2.JOB_STATE_RUNNING]

    async def model(self, job_id: str) -> JobModel:
        """The job's tokenizer and limits; UnknownModel unless the job is running (checked at most once a second,
        in the background once it was found running: renewed.py)."""
        if job_id not in self._running:
            self._running[job_id] = Renewed(lambda: self._running_job(job_id), 1.0)
        job = await self._running[job_id].get()
        if job_id in self._models:
            return self._models[job_id]
        async with self._loading.setdefault(job_id, asyncio.Lock()):
            if job_id not in self._models:
                try:
                    self._models[job_id] = await asyncio.to_thread(self._load, job_id, job.run_dir)
                except (OSError, ValueError) as exc:  # no config.yaml or model folder, no chat template
                    raise GenerateRefused(f"model {job_id!r} cannot be served: {exc}") from None
        return self._models[job_id]

    async def _running_job(self, job_id: str) -> coordinator_pb2.Job:
        """GetJob: the job, UnknownModel unless it is running."""
        try:
            job = (await self._stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=10)).job
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise UnknownModel(f"model {job_id!r}: no such job (the model is a job id; GET /v1/models)") from None
            raise ReplicaLost(f"the coordinator did not answer GetJob: {exc.code().name}") from None
        if job.state != coordinator_pb2.JOB_STATE_RUNNING:
            raise UnknownModel(f"model {job_id!r}: the job is not running")
        return job

    def _load(self, job_id: str, run_dir: str) -> JobModel:
        folder = Path(run_dir)
        if self._run_root is not None and not folder.is_absolute():
            folder = self._run_root / folder
        return load_job_model(job_id, folder)

    async def _rollout_members(self) -> list[coordinator_pb2.Member]:
        reply = await self._stub.ListMembers(coordinator_pb2.ListMembersRequest(), timeout=10)
        return [m for m in reply.members if m.kind == coordinator_pb2.MEMBER_KIND_ROLLOUT]

    async def _replicas(self, job_id: str) -> list[Replica]:
        members = await self._members.get()
        live = [m for m in members if m.status == "ALIVE" and job_id in m.weight_versions]
        return [Replica(m.name, m.address, m.load) for m in live]

    async def pick(self, job_id: str, session: str | None, size: int) -> Replica:
        """The replica for a session's call (services/endpoint/routing.py); a new session may wait for admission."""
        deadline = time.monotonic() + self.router.wait_seconds
        try:
            while True:
                replicas = await self._replicas(job_id)
                if not replicas:
                    raise ReplicaLost(f"no live rollout replica holds job {job_id!r}")
                chosen = self.router.route(session, replicas, size)
                if chosen is not None:
                    return chosen
                left = deadline - time.monotonic()
                if left <= 0:
                    self.router.stats.refused_sessions += 1
                    raise AdmissionRefused(
                        f"no replica had room for a new session within {self.router.wait_seconds:g} s "
                        f"(KV pressure over {self.router.pressure_threshold:g} on every replica)"
                    )
                await self.router.wait(min(1.0, left))
        except BaseException:  # refused, no replica, or the caller went away: it no longer waits
            if session is not None:
                self.router.abandon(session)
            raise

    async def complete(
        self,
        job_id: str,
        session: str | None,
        prompt_ids: list[int],
        n: int,
        sampling: common_pb2.SamplingParams,
        images: Prompted | None = None,
        on_tokens: TokenSink | None = None,
        *,
        top_logprobs: int = 0,
        routing: bool = False,
    ) -> Generated:
        """Generate on the session's replica (top_logprobs: Generate's alternatives per sampled token;
        routing: Generate's return_routing); a
        replica that fails the call is left and the call goes to another live one (safe: nothing of a
        failed call was recorded), else ReplicaLost. With `on_tokens`
        the call streams (GenerateStream's messages), each completion's tokens passed on as they come; a replica that
        fails after some were passed on is ReplicaLost at once (the client saw them: no other replica may
        answer instead)."""
        heard = False

        def passed_on(index: int, ids: list[int], logprobs: list[float]) -> None:
            nonlocal heard
            heard = True
            on_tokens(index, ids, logprobs)  # type: ignore[misc]

        tried: set[str] = set()
        lost = ReplicaLost(f"no live rollout replica holds job {job_id!r}")
        while True:
            replica = await self.pick(job_id, session, len(prompt_ids))
            if replica.name in tried:  # no other replica to go to
                raise lost
            if tried:
                self.router.stats.retried_calls += 1
            tried.add(replica.name)
            try:
                return await self.generate(
                    job_id,
                    replica,
                    prompt_ids,
                    n,
                    sampling,
                    images,
                    passed_on if on_tokens else None,
                    top_logprobs=top_logprobs,
                    routing=routing,
                )
            except ReplicaLost as exc:
                lost = exc
                self.router.failed(replica.name)
                self._members.forget()
                if heard:
                    raise

    def _rollout(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        if address not in self._channels:
            self._channels[address] = connect(address, service="rollout", default_timeout=self._timeout)
        return rollout_pb2_grpc.RolloutServiceStub(self._channels[address])

    def _multiplexed(self, address: str) -> MultiplexedCalls:
        """The replica's streamed calls, all on one GenerateMultiplexed stream (multiplex.py)."""
        if address not in self._streams:
            self._streams[address] = MultiplexedCalls(self._rollout(address))
        return self._streams[address]

    async def generate(
        self,
        job_id: str,
        replica: Replica,
        prompt_ids: list[int],
        n: int,
        sampling: common_pb2.SamplingParams,
        images: Prompted | None = None,
        on_tokens: TokenSink | None = None,
        *,
        top_logprobs: int = 0,
        routing: bool = False,
    ) -> Generated:
        """One Generate call on `replica` (with `on_tokens`, streamed: a call on the replica's multiplexed
        stream): GenerateRefused for the caller's fault, ReplicaLost for the replica's.

        With images, the rendered text and the image bytes go instead of ids (the model's processor
        inserts the image tokens); an engine that takes no images is the caller's fault too.
        """
        name, address = replica.name, replica.address
        request = rollout_pb2.GenerateRequest(
            job_id=job_id,
            request_id=f"endpoint-{uuid.uuid4().hex[:16]}",
            num_samples=n,
            sampling=sampling,
            top_logprobs=top_logprobs,
            return_routing=routing,
        )
        if images is None:
            request.prompt_token_ids.extend(prompt_ids)
        else:
            request.prompt, request.images[:] = images.text, images.images
        refused = {grpc.StatusCode.INVALID_ARGUMENT} | ({grpc.StatusCode.FAILED_PRECONDITION} if images else set())
        state = self.router.replicas.setdefault(name, ReplicaState())
        state.in_flight += 1
        try:
            if on_tokens is None:
                reply = await self._rollout(address).Generate(request, timeout=self._timeout)
            else:
                reply = await self._multiplexed(address).stream(request, on_tokens, self._timeout)
        except (grpc.aio.AioRpcError, CallFailed) as exc:
            if exc.code() in refused:
                raise GenerateRefused(exc.details()) from None
            # Anything else is the replica's failure (INTERNAL included), never the caller's.
            raise ReplicaLost(f"replica {name} failed mid-session: {exc.code().name}: {exc.details()}") from None
        finally:
            state.in_flight -= 1
        self.router.served(name, reply.kv_cache if reply.HasField("kv_cache") else None)
        return Generated(
            list(reply.prompt_token_ids),
            list(reply.completions),
            reply.weight_version,
            list(reply.weight_versions),
            name,
            reply.prompt_routing,
            shape_of(reply.routing_shape) if reply.HasField("routing_shape") else None,
        )
