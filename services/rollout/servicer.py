"""RolloutService over gRPC: protobuf in, calls on the replica's parts, protobuf (or a status) out.

    LoadPolicy ──parse config──> JobEngines.load (job_engines.py: torch, vLLM or SGLang) (weight_version 0)
    Generate   ──validate, prompt (text | ids | messages), images ──gate──> JobEngines.get(job).generate ──> response
               (with `staging`: the token arrays to the buffer's data plane, staging.py; the key in the response)
    GenerateStream ──the same checks──> engine.generate_stream ──> a message per batch of new tokens, then the
        response (with, as deltas, the tokens no message carried yet: those that came together with the end)
    GenerateMultiplexed ──start / cancel per call──> GenerateStream's messages of every call, batched per reply
        (multiplex.py: a decode step shared by the stream's calls is one message)
    ReceiveWeights ──> WeightReceiver.receive (weight_receiver.py: weight-sync group or checkpoint folder)
    GetEngineInfo / UnloadPolicy ──> JobEngines.get / JobEngines.unload (WeightReceiver.forget first)

Guarantees: a malformed request is refused with INVALID_ARGUMENT naming the
field whatever the state (top_logprobs outside 0..20 included; an engine that
cannot report top_logprobs refuses them with INVALID_ARGUMENT naming itself); an
unknown job is NOT_FOUND; loading and generation run in worker threads, so the server keeps answering (health
included) while they run; a retried LoadPolicy for a loaded job changes
nothing. A Generate without a `sampling` message uses the job's
`policy.generation` defaults; one with it is taken literally (proto3: an unset
temperature is 0, greedy). Weight versions are set only by the weight sync.
A failed weight sync is UNAVAILABLE with its cause, within the sync timeout;
the weight-sync group has then been torn down and the next ReceiveWeights forms the
coordinator's next epoch. Until a ReceiveWeights of the job succeeds again, its Generate
and GenerateStream are UNAVAILABLE saying why (the failed receive may have replaced part
of the weights), and so is a generation that a failed receive overlapped. backend=vllm on a replica without vLLM is
FAILED_PRECONDITION naming the missing package. A job id outside
dockyard.jobs.JOB_ID, a config beyond the config bounds (parsed off the event
loop) and a prompt beyond the bounds of services/rollout/prompts.py are INVALID_ARGUMENT; a Generate whose
caller has already gone (cancelled, or past its deadline) starts no generation,
and one whose caller goes while it runs is stopped at the engine's next decode
step (the handler is cancelled, or its deadline passes: DEADLINE_EXCEEDED). GenerateStream refuses
and stops exactly as Generate does; its last message's `result` is what Generate would return, and
every token of it comes in exactly one message's deltas, in order (the last message's included).
GenerateMultiplexed runs each call exactly as GenerateStream (its timeout_seconds the deadline) and a call's
failure ends that call alone with GenerateStream's status; once the service drains, its streams refuse new calls
(UNAVAILABLE) and end when theirs have.
Images pass the job's multimodal gate (dockyard/images.py) here, the rollout boundary: gate off,
too many, too large or unreadable is INVALID_ARGUMENT; an engine that takes no images (vLLM,
SGLang, a text-only policy) is FAILED_PRECONDITION; the text path never touches the gate.
A Generate naming a staging destination answers either with the staged key and no token arrays
(every completion's num_tokens set), or, where staging failed (logged), with the arrays; an empty
staging field is INVALID_ARGUMENT, and GenerateStream refuses staging. With return_routing a
mixture-of-experts policy's routing comes back (or is staged) beside its tokens, position for position
(services/rollout/engine.py); an engine that cannot capture it is FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator

import grpc
import structlog

from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.config import ConfigError, MasterConfig, parse_config_text
from dockyard.experience.routing_layout import to_bytes
from dockyard.images import ImageLimits, ImageRejected, gate_images
from dockyard.jobs import job_id_error
from dockyard.rpc.completion import run_to_completion
from dockyard.rpc.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from dockyard.weights.synchronizer import WeightSyncFailed
from services.rollout.decoding import (
    DecodingParams,
    decoding_from_proto,
    default_decoding,
    validate_num_samples,
    validate_top_logprobs,
)
from services.rollout.engine import GenerationEngine, GenerationResult, Prompt, TokenDelta, UnsupportedRequest
from services.rollout.job_engines import JobEngines, build_engine
from services.rollout.multiplex import MultiplexedStream, Send, TimeLeft, wait_out
from services.rollout.prompts import check_context, prompt_from_request
from services.rollout.settings import RolloutSettings
from services.rollout.staging import PayloadStager
from services.rollout.weight_receiver import WeightReceiver, WeightsTorn
from services.rollout.wire import completion_proto, delta_proto, kv_cache_proto, merge_into, routing_shape_proto

log = structlog.get_logger()


def _check_staging(staging: rollout_pb2.PayloadStaging) -> None:
    for name, value in (
        ("data_plane.redis_url", staging.data_plane.redis_url),
        ("data_plane.key_prefix", staging.data_plane.key_prefix),
        ("group_id", staging.group_id),
    ):
        if not value:
            raise InvalidArgument(f"staging.{name} is empty; name the buffer's data plane as GetDataPlane gave it")


def _time_left(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left to the caller's deadline (None: none); DeadlineExceeded when it has gone, for nobody
    would read the result: no generation starts for it."""
    remaining = context.time_remaining()
    if context.cancelled() or (remaining is not None and remaining <= 0):
        raise DeadlineExceeded("the caller gave up before generation started")
    return remaining


def _require_job_id(job_id: str) -> None:
    if error := job_id_error(job_id):
        raise InvalidArgument(error)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """The RPCs over the replica's engines (`jobs`) and its side of the weight sync (`weights`)."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.jobs = JobEngines(settings.device)
        self.weights = WeightReceiver(settings)
        self.in_flight = 0  # Generate calls running now: the load this replica reports in heartbeats
        self.stager = PayloadStager()
        self._streams: set[MultiplexedStream] = set()  # GenerateMultiplexed streams serving now
        self._draining = False

    @property
    def engines(self) -> dict[str, GenerationEngine]:
        return self.jobs.engines

    @property
    def configs(self) -> dict[str, MasterConfig]:
        return self.jobs.configs

    def kv_pressure(self) -> float:
        """The highest prefix-cache pressure over the loaded engines (heartbeats report it); 0 without one."""
        return self.jobs.kv_pressure()

    def engine(self, job_id: str) -> GenerationEngine:
        """The job's engine: InvalidArgument for a malformed job id, NotFound for one not loaded."""
        _require_job_id(job_id)
        return self.jobs.get(job_id)

    async def LoadPolicy(
        self, request: rollout_pb2.LoadPolicyRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadPolicyResponse:
        _require_job_id(request.job_id)
        if not request.config_yaml.strip():
            raise InvalidArgument("config_yaml is empty")
        try:
            cfg = await parse_config_text(request.config_yaml, origin="config_yaml")
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        if mismatch := cfg.cluster.device_mismatch("rollout", self.settings.device):
            raise FailedPrecondition(mismatch)
        engine = await self.jobs.load(request.job_id, cfg, self._build_engine)
        return rollout_pb2.LoadPolicyResponse(engine=engine.name, weight_version=engine.weight_version)

    async def _build_engine(self, cfg: MasterConfig) -> GenerationEngine:
        return await build_engine(cfg, self.settings.device)

    def _default_decoding(self, job_id: str) -> DecodingParams:
        return default_decoding(
            self.jobs.config(job_id).policy.generation, max_new_tokens_ceiling=self.settings.max_new_tokens_ceiling
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        engine, prompt, num_samples, decoding = await self._prepare(request)
        remaining = _time_left(context)
        # grpc.aio cancels this handler when the caller cancels; the deadline is enforced here too.
        with self._generating(request.job_id):
            async with asyncio.timeout(remaining):
                result = await engine.generate(prompt, num_samples, decoding)
        staged = None
        if request.HasField("staging"):
            routing = result if request.return_routing else None
            staged = await self.stager.stage(request.job_id, request.staging, result, routing)
        return self._response(engine, result, staged, request.return_routing)

    async def GenerateStream(
        self, request: rollout_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateStreamResponse]:
        unsent: list[rollout_pb2.GenerateStreamResponse] = []  # at most one: what came while a write ran, merged
        ready = asyncio.Event()

        def send(message: rollout_pb2.GenerateStreamResponse) -> None:
            if unsent:
                merge_into(unsent[0], message)
            else:
                unsent.append(message)
            ready.set()

        call = asyncio.ensure_future(self._stream(request, lambda: _time_left(context), send))
        ended = asyncio.Event()  # the call is over: its last message goes without waiting out the interval
        call.add_done_callback(lambda _: (ended.set(), ready.set()))
        loop, interval = asyncio.get_running_loop(), self.settings.stream_interval_ms / 1000
        try:
            while not call.done():
                await ready.wait()
                ready.clear()
                if unsent and not call.done():
                    sent_at = loop.time()
                    yield unsent.pop()
                    await wait_out(sent_at + interval, ended)
            last = call.result()  # the call's failure raised
            if unsent:
                merge_into(unsent[0], last)
                last = unsent.pop()
            yield last
        finally:
            call.cancel()  # the caller went away: the generation stops at its next decode step
            if call.done() and not call.cancelled():
                call.exception()  # read: a failure the caller left before hearing is not logged as lost

    async def GenerateMultiplexed(
        self,
        requests: AsyncIterator[rollout_pb2.GenerateMultiplexedRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.GenerateMultiplexedResponse]:
        stream = MultiplexedStream(self._stream, self.settings.stream_interval_ms / 1000)
        if self._draining:
            stream.drain()
        self._streams.add(stream)
        try:
            async for reply in stream.serve(requests):
                yield reply
        finally:
            self._streams.discard(stream)

    def drain(self) -> None:
        """The service is stopping: multiplexed streams take no new call and end once theirs have ended."""
        self._draining = True
        for stream in self._streams:
            stream.drain()

    async def _stream(
        self, request: rollout_pb2.GenerateStreamRequest, time_left: TimeLeft, send: Send
    ) -> rollout_pb2.GenerateStreamResponse:
        """Runs one GenerateStream call: each message but the last to `send` as its tokens are sampled (on this
        loop, never after this returned); the last, with the result, returned. `time_left` says, once the call
        is prepared, how long it may take."""
        if request.request.HasField("staging"):
            raise InvalidArgument("request.staging: GenerateStream streams the tokens back; stage with Generate")
        engine, prompt, num_samples, decoding = await self._prepare(request.request)
        remaining = time_left()
        sent: dict[int, int] = {}  # tokens sent as deltas, per completion
        # The engine hands tokens on at the pace its messages go: a wake-up of this loop per step would slow
        # the decode steps of every call on the replica (the loop and the decode thread share the GIL).
        interval = self.settings.stream_interval_ms / 1000

        def on_deltas(deltas: list[TokenDelta]) -> None:
            for d in deltas:
                sent[d.index] = sent.get(d.index, 0) + len(d.token_ids)
            send(rollout_pb2.GenerateStreamResponse(deltas=[delta_proto(*d) for d in deltas]))

        # As Generate: the caller going away cancels this call, which stops the engine's rows.
        with self._generating(request.request.job_id):
            async with asyncio.timeout(remaining):
                result = await engine.generate_stream(prompt, num_samples, decoding, on_deltas, interval)
        # The tokens no message carried yet (the engine's last ones and those it held, or all of an engine that
        # does not stream) go with the result: one message where two would go back to back.
        rest = [
            delta_proto(i, c.token_ids[sent.get(i, 0) :], c.logprobs[sent.get(i, 0) :])
            for i, c in enumerate(result.completions)
            if len(c.token_ids) > sent.get(i, 0)
        ]
        response = self._response(engine, result, routing=request.request.return_routing)
        return rollout_pb2.GenerateStreamResponse(deltas=rest, result=response)

    @contextlib.contextmanager
    def _generating(self, job_id: str) -> Iterator[None]:
        """One generation in flight (counted): the engine's refusal is INVALID_ARGUMENT, a deadline that
        passed during it DEADLINE_EXCEEDED, weights a failed receive may have mixed UNAVAILABLE."""
        self.in_flight += 1
        try:
            failed = self.weights.check(job_id)
            yield
            self.weights.check(job_id, since=failed)
        except WeightsTorn as exc:
            raise Unavailable(f"job {job_id}: {exc}") from None
        except UnsupportedRequest as exc:
            raise InvalidArgument(str(exc)) from None
        except TimeoutError:
            raise DeadlineExceeded("the caller's deadline passed during generation") from None
        finally:
            self.in_flight -= 1

    async def _prepare(
        self, request: rollout_pb2.GenerateRequest
    ) -> tuple[GenerationEngine, Prompt, int, DecodingParams]:
        """A Generate request checked and resolved: the engine, prompt, group size and decoding."""
        # Arguments first: INVALID_ARGUMENT does not depend on what is loaded.
        _require_job_id(request.job_id)
        num_samples = validate_num_samples(request.num_samples)
        top_logprobs = validate_top_logprobs(request.top_logprobs)
        prompt_input = prompt_from_request(request)
        if request.HasField("staging"):
            _check_staging(request.staging)
        decoding = None
        if request.HasField("sampling"):
            decoding = decoding_from_proto(
                request.sampling, max_new_tokens_ceiling=self.settings.max_new_tokens_ceiling
            )
        engine = self.engine(request.job_id)
        if request.return_routing and not engine.captures_routing:
            raise FailedPrecondition(
                f"return_routing: the {engine.name} engine does not capture expert routing; "
                "use policy.generation.backend=torch"
            )
        if decoding is None:
            decoding = self._default_decoding(request.job_id)
        decoding = dataclasses.replace(decoding, top_logprobs=top_logprobs)
        images = await self._gate_images(request, engine)
        try:
            prompt = await asyncio.to_thread(prompt_input.resolve, engine, images)
        except UnsupportedRequest as exc:
            raise InvalidArgument(str(exc)) from None
        await check_context(engine, prompt, decoding.max_new_tokens)
        return engine, prompt, num_samples, decoding

    def _response(
        self,
        engine: GenerationEngine,
        result: GenerationResult,
        staged: tuple[str, int] | None = None,
        routing: bool = False,
    ) -> rollout_pb2.GenerateResponse:
        """The result on the wire; with `staged` (key, bytes), its token arrays are in that payload instead;
        `routing`: with the experts each position was routed to (a mixture-of-experts policy's)."""
        key, size = staged or ("", 0)
        shape = result.routing_shape if routing else None
        response = rollout_pb2.GenerateResponse(
            prompt_token_ids=() if staged else result.prompt_token_ids,
            completions=[
                completion_proto(c, staged=bool(staged), routing=result if shape else None) for c in result.completions
            ],
            weight_version=result.weight_version,
            weight_versions=result.weight_versions,
            kv_cache=kv_cache_proto(engine.kv_cache_stats),
            payload_key=key,
            payload_bytes=size,
        )
        if shape is not None:
            response.routing_shape.CopyFrom(routing_shape_proto(shape))
            if not staged and result.prompt_routing is not None:
                response.prompt_routing = to_bytes(result.prompt_routing, shape)
        return response

    async def _gate_images(self, request: rollout_pb2.GenerateRequest, engine: GenerationEngine) -> list:
        """The request's images through the job's gate (dockyard/images.py), decoded off the event loop."""
        if not request.images:
            return []
        limits = ImageLimits.from_generation(self.jobs.config(request.job_id).policy.generation)
        try:
            images = await asyncio.to_thread(gate_images, list(request.images), limits)
        except ImageRejected as exc:
            raise InvalidArgument(str(exc)) from None
        if (refusal := engine.image_refusal) is not None:
            raise FailedPrecondition(f"images: {refusal}")
        return images

    async def ReceiveWeights(
        self, request: rollout_pb2.ReceiveWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ReceiveWeightsResponse:
        # Finished even if the caller goes away: the sync lock is never left while a transfer runs.
        return await run_to_completion(self._receive_weights(request))

    async def _receive_weights(self, request: rollout_pb2.ReceiveWeightsRequest) -> rollout_pb2.ReceiveWeightsResponse:
        engine = self.engine(request.job_id)
        if request.weight_version < 0:
            raise InvalidArgument(f"weight_version must be >= 0, got {request.weight_version}")
        config = self.jobs.config(request.job_id)
        try:
            report = await self.weights.receive(request.job_id, engine, config, request.weight_version)
        except WeightSyncFailed as exc:
            raise Unavailable(str(exc)) from None
        log.info("weights received", version=request.weight_version, seconds=round(report.seconds, 3))
        return rollout_pb2.ReceiveWeightsResponse(
            weight_version=request.weight_version,
            checksum=report.checksum,
            num_bytes=report.num_bytes,
            seconds=report.seconds,
        )

    async def GetEngineInfo(
        self, request: rollout_pb2.GetEngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetEngineInfoResponse:
        engine = self.engine(request.job_id)
        return rollout_pb2.GetEngineInfoResponse(
            engine=engine.name,
            model=engine.model_name,
            weight_version=engine.weight_version,
            num_parameters=engine.num_parameters,
        )

    async def UnloadPolicy(
        self, request: rollout_pb2.UnloadPolicyRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.UnloadPolicyResponse:
        self.engine(request.job_id)
        await self.jobs.unload(request.job_id, detach=self.weights.forget)
        log.info("policy unloaded")
        return rollout_pb2.UnloadPolicyResponse()

    async def close(self) -> None:
        await self.stager.close()
        await self.weights.close()
        await self.jobs.close()
