"""RolloutService over gRPC: one generation engine per job.

    LoadPolicy ──parse config──> engine (torch, or vLLM's AsyncLLM) ──> engines[job_id]  (weight_version 0)
    Generate   ──validate, prompt (text | ids | messages), images ──gate──> engines[job_id].generate ──> response
    ReceiveWeights ──WeightSynchronizer (weight-sync group or checkpoint folder)──> engine.receive_weights
    GetEngineInfo / UnloadPolicy ──> engines[job_id]

Guarantees: a malformed request is refused with INVALID_ARGUMENT naming the
field whatever the state; an unknown job is NOT_FOUND; loading and
generation run in worker threads, so the server keeps answering (health
included) while they run; a retried LoadPolicy for a loaded job changes
nothing. A Generate without a `sampling` message uses the job's
`policy.generation` defaults; one with it is taken literally (proto3: an unset
temperature is 0, greedy). Weight versions are set only by the weight sync.
A failed weight sync is UNAVAILABLE with its cause, within the sync timeout;
the weight-sync group has then been torn down and the next ReceiveWeights forms the
coordinator's next epoch. backend=vllm on a replica without vLLM is
FAILED_PRECONDITION naming the missing package. A job id outside
dockyard.jobs.JOB_ID, a config beyond the config bounds (parsed off the event
loop) and a prompt beyond the bounds of services/rollout/prompts.py are INVALID_ARGUMENT; a Generate whose
caller has already gone (cancelled, or past its deadline) starts no generation,
and one whose caller goes while it runs is stopped at the engine's next decode
step (the handler is cancelled, or its deadline passes: DEADLINE_EXCEEDED).
Images pass the job's multimodal gate (dockyard/images.py) here, the rollout boundary: gate off,
too many, too large or unreadable is INVALID_ARGUMENT; an engine that takes no images (vLLM,
SGLang, a text-only policy) is FAILED_PRECONDITION; the text path never touches the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from datetime import timedelta

import grpc
import structlog

from dockyard.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.config import ConfigError, MasterConfig, parse_config_text
from dockyard.images import ImageLimits, ImageRejected, gate_images
from dockyard.jobs import job_id_error
from dockyard.rpc.client import connect
from dockyard.rpc.completion import run_to_completion
from dockyard.rpc.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from dockyard.weights.group_source import coordinator_group_source, transport_for
from dockyard.weights.synchronizer import WeightSyncFailed, WeightSynchronizer
from services.rollout.decoding import (
    DecodingParams,
    decoding_from_proto,
    validate_decoding,
    validate_num_samples,
)
from services.rollout.engine import GenerationEngine, ImagePrompt, Prompt, UnsupportedRequest
from services.rollout.prompts import prompt_from_request
from services.rollout.settings import RolloutSettings

log = structlog.get_logger()


def kv_cache_proto(stats) -> rollout_pb2.KvCacheStats | None:
    """An engine's prefix cache counters (PrefixStats) on the wire; None (unset) when it reports none."""
    if stats is None:
        return None
    return rollout_pb2.KvCacheStats(
        capacity_tokens=stats.capacity_tokens,
        live_tokens=stats.live_tokens,
        cached_tokens=stats.cached_tokens,
        cached_entries=stats.cached_entries,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        prefill_tokens_saved=stats.prefill_tokens_saved,
        evictions=stats.evictions,
        pressure=stats.pressure,
    )


def _require_job_id(job_id: str) -> None:
    if error := job_id_error(job_id):
        raise InvalidArgument(error)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Engines by job id; the weight sync reaches them through `engines`."""

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.engines: dict[str, GenerationEngine] = {}
        self.configs: dict[str, MasterConfig] = {}
        self.syncs: dict[str, WeightSynchronizer] = {}
        self._sync_lock = asyncio.Lock()
        self._coordinator_channel = connect(
            settings.coordinator_address,
            service="dockyard.coordinator.v1.CoordinatorService",
            max_message_mb=settings.max_message_mb,
        )
        self.coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(self._coordinator_channel)
        self.in_flight = 0  # Generate calls running now: the load this replica reports in heartbeats
        # One load at a time: two concurrent loads of one job would build two engines.
        self._load_lock = asyncio.Lock()

    def kv_pressure(self) -> float:
        """The highest prefix-cache pressure over the loaded engines (heartbeats report it); 0 without one."""
        stats = [e.kv_cache_stats for e in list(self.engines.values())]
        return max((s.pressure for s in stats if s is not None), default=0.0)

    def engine(self, job_id: str) -> GenerationEngine:
        """The job's engine, or NotFound."""
        _require_job_id(job_id)
        try:
            return self.engines[job_id]
        except KeyError:
            raise NotFound(f"no policy loaded for job {job_id!r}; call LoadPolicy first") from None

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
        async with self._load_lock:
            engine = self.engines.get(request.job_id)
            if engine is None:
                engine = await self._build_engine(cfg)
                if cfg.data.chat_template and not getattr(engine.tokenizer, "chat_template", None):
                    await engine.close()
                    raise FailedPrecondition(
                        "data.chat_template is true but the policy's tokenizer has no chat_template: use a "
                        "tokenizer with one (chat_template in tokenizer_config.json), or set data.chat_template=false"
                    )
                self.engines[request.job_id] = engine
                self.configs[request.job_id] = cfg
                log.info("policy loaded", engine=engine.name, model=engine.model_name, device=self.settings.device)
        return rollout_pb2.LoadPolicyResponse(engine=engine.name, weight_version=engine.weight_version)

    async def _build_engine(self, cfg: MasterConfig) -> GenerationEngine:
        if cfg.policy.generation.backend == "vllm":
            from services.rollout.vllm_engine import VllmEngine, VllmUnavailable

            try:
                return await VllmEngine.create(cfg, self.settings.device)
            except VllmUnavailable as exc:
                raise FailedPrecondition(str(exc)) from None
        if cfg.policy.generation.backend == "sglang":
            from services.rollout.sglang_engine import SglangEngine, SglangUnavailable

            try:
                return await SglangEngine.create(cfg, self.settings.device)
            except SglangUnavailable as exc:
                raise FailedPrecondition(str(exc)) from None
        return await asyncio.to_thread(self._build_torch_engine, cfg)

    def _build_torch_engine(self, cfg: MasterConfig) -> GenerationEngine:
        from dockyard.models.load import load_policy, load_processor
        from services.rollout.fp8 import Fp8Unavailable

        try:
            model, tokenizer = load_policy(cfg.policy, self.settings.device)
            processor = load_processor(cfg.policy) if cfg.policy.generation.allow_multimodal_inputs else None
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        except FileNotFoundError as exc:
            raise FailedPrecondition(str(exc)) from None
        kv_cache = cfg.policy.generation.kv_cache
        if kv_cache == "auto":
            kv_cache = "static" if self.settings.device.startswith("cuda") else "dynamic"
        try:
            return self._torch_engine(cfg, model, tokenizer, processor, kv_cache)
        except Fp8Unavailable as exc:
            raise FailedPrecondition(str(exc)) from None

    def _torch_engine(self, cfg: MasterConfig, model, tokenizer, processor, kv_cache: str):
        from services.rollout.torch_engine import TorchEngine

        return TorchEngine(
            model,
            tokenizer,
            self.settings.device,
            model_name=cfg.policy.model_name or "",
            kv_cache=kv_cache,
            in_flight_weight_updates=cfg.grpo.async_grpo.in_flight_weight_updates,
            max_batch_rows=cfg.policy.generation.max_batch_rows,
            prefix_cache_tokens=cfg.policy.generation.prefix_cache_tokens,
            precision=cfg.policy.generation.precision,
            processor=processor,
            contiguous_weights=cfg.cluster.weight_sync_transport == "colocated",
        )

    def _default_decoding(self, job_id: str) -> DecodingParams:
        gen = self.configs[job_id].policy.generation
        return validate_decoding(
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            max_new_tokens=gen.max_new_tokens,
            stop=gen.stop_strings,
            ignore_eos=gen.ignore_eos,
            seed=None,
            max_new_tokens_ceiling=self.settings.max_new_tokens_ceiling,
            prefix="policy.generation.",
        )

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        # Arguments first: INVALID_ARGUMENT does not depend on what is loaded.
        _require_job_id(request.job_id)
        num_samples = validate_num_samples(request.num_samples)
        prompt_input = prompt_from_request(request)
        decoding = None
        if request.HasField("sampling"):
            decoding = decoding_from_proto(
                request.sampling, max_new_tokens_ceiling=self.settings.max_new_tokens_ceiling
            )
        engine = self.engine(request.job_id)
        if decoding is None:
            decoding = self._default_decoding(request.job_id)
        images = await self._gate_images(request, engine)
        try:
            prompt = await asyncio.to_thread(prompt_input.resolve, engine, images)
        except UnsupportedRequest as exc:
            raise InvalidArgument(str(exc)) from None
        await _check_context(engine, prompt, decoding.max_new_tokens)
        remaining = context.time_remaining()
        if context.cancelled() or (remaining is not None and remaining <= 0):
            # Nobody would read the result: no generation for it.
            raise DeadlineExceeded("the caller gave up before generation started")
        self.in_flight += 1
        try:
            # grpc.aio cancels this handler when the caller cancels; the deadline is enforced here too.
            async with asyncio.timeout(remaining):
                result = await engine.generate(prompt, num_samples, decoding)
        except UnsupportedRequest as exc:
            raise InvalidArgument(str(exc)) from None
        except TimeoutError:
            raise DeadlineExceeded("the caller's deadline passed during generation") from None
        finally:
            self.in_flight -= 1
        return rollout_pb2.GenerateResponse(
            prompt_token_ids=result.prompt_token_ids,
            completions=[
                rollout_pb2.Completion(
                    token_ids=c.token_ids, logprobs=c.logprobs, text=c.text, finish_reason=c.finish_reason
                )
                for c in result.completions
            ],
            weight_version=result.weight_version,
            weight_versions=result.weight_versions,
            kv_cache=kv_cache_proto(engine.kv_cache_stats),
        )

    async def _gate_images(self, request: rollout_pb2.GenerateRequest, engine: GenerationEngine) -> list:
        """The request's images through the job's gate (dockyard/images.py), decoded off the event loop."""
        if not request.images:
            return []
        limits = ImageLimits.from_generation(self.configs[request.job_id].policy.generation)
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
        timeout = timedelta(seconds=self.settings.weight_sync_timeout_seconds)
        async with self._sync_lock:
            sync = self.syncs.get(request.job_id)
            if sync is None:
                sync = self.syncs[request.job_id] = WeightSynchronizer(
                    transport_for(self.configs[request.job_id], request.job_id, timeout, self.settings.device),
                    coordinator_group_source(self.coordinator, request.job_id, self.settings.replica_name),
                )
            sync.mark_stale(request.weight_version)

            async def load(transport, version, group):
                return await engine.receive_weights(transport, version, group, timeout)

            try:
                report = await sync.sync_weights(load, request.weight_version)
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
        async with self._load_lock:
            self.configs.pop(request.job_id, None)
            engine = self.engines.get(request.job_id)
            if (sync := self.syncs.pop(request.job_id, None)) is not None:
                sync.close()
                await self._leave(request.job_id)
            self.engines.pop(request.job_id, None)
            if engine is not None:
                await engine.close()
        _free_memory()
        log.info("policy unloaded")
        return rollout_pb2.UnloadPolicyResponse()

    async def _leave(self, job_id: str) -> None:
        """Best effort: the coordinator forms the job's group again without this replica."""
        with contextlib.suppress(Exception):
            await self.coordinator.LeaveWeightSyncGroup(
                coordinator_pb2.LeaveWeightSyncGroupRequest(job_id=job_id, member=self.settings.replica_name),
                timeout=5.0,
            )

    async def close(self) -> None:
        for sync in self.syncs.values():
            sync.close()
        self.syncs.clear()
        await self._coordinator_channel.close()
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                await engine.close()
        self.engines.clear()
        self.configs.clear()
        _free_memory()


async def _check_context(engine: GenerationEngine, prompt: Prompt, max_new_tokens: int) -> None:
    """INVALID_ARGUMENT when the prompt and its new tokens cannot fit the model's context."""
    if (context := engine.context_tokens) is None:
        return
    if isinstance(prompt, ImagePrompt):
        return  # image tokens are counted by the processor; the model's own limit applies
    if isinstance(prompt, str):
        tokens = len(await asyncio.to_thread(lambda: engine.tokenizer(prompt)["input_ids"]))
    else:
        tokens = len(prompt)
    if tokens + max_new_tokens > context:
        raise InvalidArgument(
            f"prompt is {tokens} tokens; with max_new_tokens {max_new_tokens} that exceeds the model's "
            f"context of {context} tokens"
        )


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
