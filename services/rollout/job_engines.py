"""The rollout replica's engines by job: built from the job config, found by job id, closed on unload.

    job config ──build_engine(cfg, device)──> torch | vLLM | SGLang engine
        ──JobEngines.load(job_id, cfg, build)──> engines[job_id], configs[job_id]  (weight_version 0)
    JobEngines.get(job_id) ──> the engine, or NotFound
    JobEngines.unload(job_id, detach) ──detach (the weight sync leaves)──> engine.close() ──> free_memory()

Guarantees:
- one load or unload at a time: two concurrent loads of one job never build two
  engines, and a load of a job already loaded changes nothing (returns the engine
  it has);
- a job is registered only with an engine that passed the load checks: with
  data.chat_template, its tokenizer has a chat template, else the engine is closed
  and the load is FAILED_PRECONDITION;
- the backend's own refusals map to domain errors here: a missing vLLM or SGLang
  package, a missing model folder or an fp8 request the device cannot serve are
  FailedPrecondition; a model the config cannot build is InvalidArgument;
- after an unload or close, unreferenced objects are collected and CUDA's cached
  blocks returned to the device (`free_memory`), so the next job's engine fits.

Imports: dockyard.config, dockyard.rpc.errors, services.rollout.engine; the engine
modules (torch, vLLM, SGLang) and model loading only inside `build_engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Awaitable, Callable

import structlog

from dockyard.config import ConfigError, MasterConfig
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument, NotFound
from services.rollout.engine import GenerationEngine

log = structlog.get_logger()

Build = Callable[[MasterConfig], Awaitable[GenerationEngine]]


async def build_engine(cfg: MasterConfig, device: str) -> GenerationEngine:
    """The engine `cfg.policy.generation.backend` names, on `device`; the slow work runs off the event loop."""
    if cfg.policy.generation.backend == "vllm":
        from services.rollout.vllm_engine import VllmEngine, VllmUnavailable

        try:
            return await VllmEngine.create(cfg, device)
        except VllmUnavailable as exc:
            raise FailedPrecondition(str(exc)) from None
        except ConfigError as exc:  # an MoE family dockyard does not support (dockyard/models/moe.py)
            raise InvalidArgument(str(exc)) from None
    if cfg.policy.generation.backend == "sglang":
        from services.rollout.sglang_engine import SglangEngine, SglangUnavailable

        try:
            return await SglangEngine.create(cfg, device)
        except SglangUnavailable as exc:
            raise FailedPrecondition(str(exc)) from None
    return await asyncio.to_thread(_build_torch_engine, cfg, device)


def _build_torch_engine(cfg: MasterConfig, device: str) -> GenerationEngine:
    from dockyard.models.load import load_policy, load_processor
    from dockyard.models.moe import moe_family
    from services.rollout.fp8 import Fp8Unavailable

    try:
        model, tokenizer = load_policy(cfg.policy, device)
        processor = load_processor(cfg.policy) if cfg.policy.generation.allow_multimodal_inputs else None
    except ConfigError as exc:
        raise InvalidArgument(str(exc)) from None
    except FileNotFoundError as exc:
        raise FailedPrecondition(str(exc)) from None
    kv_cache = cfg.policy.generation.kv_cache
    if kv_cache == "auto":  # a mixture-of-experts policy decodes without graphs (services/rollout/torch_engine.py)
        kv_cache = "static" if device.startswith("cuda") and moe_family(model.config) is None else "dynamic"
    try:
        return _torch_engine(cfg, device, model, tokenizer, processor, kv_cache)
    except Fp8Unavailable as exc:
        raise FailedPrecondition(str(exc)) from None
    except ConfigError as exc:
        raise InvalidArgument(str(exc)) from None


def _torch_engine(cfg: MasterConfig, device: str, model, tokenizer, processor, kv_cache: str) -> GenerationEngine:
    from services.rollout.torch_engine import TorchEngine

    return TorchEngine(
        model,
        tokenizer,
        device,
        model_name=cfg.policy.model_name or "",
        kv_cache=kv_cache,
        in_flight_weight_updates=cfg.grpo.async_grpo.in_flight_weight_updates,
        max_batch_rows=cfg.policy.generation.max_batch_rows,
        prefix_cache_tokens=cfg.policy.generation.prefix_cache_tokens,
        precision=cfg.policy.generation.precision,
        processor=processor,
        contiguous_weights=cfg.cluster.weight_sync_transport == "colocated",
    )


def free_memory() -> None:
    """Collect what closed engines left and hand CUDA's cached blocks back to the device."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class JobEngines:
    """Each loaded job's engine and config, by job id (`engines` and `configs` hold the same keys)."""

    def __init__(self, device: str) -> None:
        self.device = device  # for the load log line
        self.engines: dict[str, GenerationEngine] = {}
        self.configs: dict[str, MasterConfig] = {}
        # One load at a time: two concurrent loads of one job would build two engines.
        self._load_lock = asyncio.Lock()

    def get(self, job_id: str) -> GenerationEngine:
        """The job's engine, or NotFound."""
        try:
            return self.engines[job_id]
        except KeyError:
            raise NotFound(f"no policy loaded for job {job_id!r}; call LoadPolicy first") from None

    def config(self, job_id: str) -> MasterConfig:
        """The config the job was loaded with (the job is loaded: `get` found it)."""
        return self.configs[job_id]

    async def load(self, job_id: str, cfg: MasterConfig, build: Build) -> GenerationEngine:
        """The job's engine: the one loaded already, or a new one from `build(cfg)` that passed the load checks."""
        async with self._load_lock:
            engine = self.engines.get(job_id)
            if engine is not None:
                return engine
            engine = await build(cfg)
            if cfg.data.chat_template and not getattr(engine.tokenizer, "chat_template", None):
                await engine.close()
                raise FailedPrecondition(
                    "data.chat_template is true but the policy's tokenizer has no chat_template: use a "
                    "tokenizer with one (chat_template in tokenizer_config.json), or set data.chat_template=false"
                )
            self.engines[job_id] = engine
            self.configs[job_id] = cfg
            log.info("policy loaded", engine=engine.name, model=engine.model_name, device=self.device)
            return engine

    async def unload(self, job_id: str, detach: Callable[[str], Awaitable[None]]) -> None:
        """Forget the job: `detach(job_id)` first (its weight sync leaves), then its engine closes; memory freed."""
        async with self._load_lock:
            self.configs.pop(job_id, None)
            engine = self.engines.get(job_id)
            await detach(job_id)
            self.engines.pop(job_id, None)
            if engine is not None:
                await engine.close()
        free_memory()

    def kv_pressure(self) -> float:
        """The highest prefix-cache pressure over the loaded engines (heartbeats report it); 0 without one."""
        stats = [e.kv_cache_stats for e in list(self.engines.values())]
        return max((s.pressure for s in stats if s is not None), default=0.0)

    async def close(self) -> None:
        """Close every engine (an engine's failure to close stops none of the others) and free memory."""
        for engine in self.engines.values():
            with contextlib.suppress(Exception):
                await engine.close()
        self.engines.clear()
        self.configs.clear()
        free_memory()
