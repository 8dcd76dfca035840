"""vLLM's AsyncLLM behind the GenerationEngine interface; vLLM is imported only when a job asks for it.

    LoadPolicy(backend=vllm) ──import vllm (VllmUnavailable if missing)──> env_vars into the environment
        ──AsyncEngineArgs(model folder, dtype, seed, worker_extension_cls, logprobs_mode, vllm_cfg...)──> AsyncLLM
    generate ──our tokenizer──> {"prompt_token_ids"} + vllm.SamplingParams(n, ..., logprobs=0) ──> Completions
    receive_weights ──collective_rpc("dockyard_receive")──> every worker loads through vllm_worker.py

Guarantees (by construction against vLLM's documented API; vLLM cannot be
installed where dockyard's CI runs, so this engine is exercised there only
against a stand-in module, never against vLLM itself):
- logprobs follow the engine convention (after temperature, before
  top-p/top-k): vLLM runs with logprobs_mode="processed_logprobs", which is
  exactly that when no truncation applies; a request with top_p < 1 or
  top_k > 0 is refused (UnsupportedRequest naming the field) rather than
  answered with logprobs of the truncated distribution;
- a stop string is kept in the completion (include_stop_str_in_output);
  finish reasons map to "eos", "stop" and "length";
- `policy.generation.vllm_cfg.env_vars` is set in this process's environment
  before AsyncLLM starts, so vLLM's worker processes (which inherit it) see it;
- weights load by checkpoint name through vLLM's `load_weights` in each
  worker; afterwards the prefix cache is reset (prepare_for_generation);
- without in-flight updates a load waits until no generation runs; with
  them it lands between vLLM's engine steps and each result lists every
  version its generation spanned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch

from dockyard.config import MasterConfig
from dockyard.weights.collective import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.transports import Transport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import Completion, GenerationEngine, GenerationResult, UnsupportedRequest

WORKER_EXTENSION = "services.rollout.vllm_worker.WeightLoaderExtension"
# Set by the engine itself; a vllm_cfg that sets them would break the contract above.
ENGINE_OWNED = ("model", "worker_extension_cls", "logprobs_mode", "tokenizer", "skip_tokenizer_init")


class VllmUnavailable(RuntimeError):
    """vLLM cannot be imported on this replica."""


def import_vllm() -> tuple[Any, Any]:
    """(the vllm module, AsyncLLM), or VllmUnavailable with what to do."""
    try:
        import vllm
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise VllmUnavailable(
            "policy.generation.backend=vllm: vLLM is not importable on this rollout replica "
            f"({exc}); install vllm there or use policy.generation.backend=torch"
        ) from None
    return vllm, AsyncLLM


def engine_arguments(cfg: MasterConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """(AsyncEngineArgs keyword arguments, worker environment) from the job config; ValueError names the field."""
    options = dict(cfg.policy.generation.vllm_cfg)
    env = options.pop("env_vars", None) or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ValueError("policy.generation.vllm_cfg.env_vars: must be a mapping of variable names to values")
    owned = [key for key in ENGINE_OWNED if key in options]
    if owned:
        raise ValueError(f"policy.generation.vllm_cfg: {', '.join(owned)} is set by the engine; remove it")
    if int(options.get("tensor_parallel_size", 1)) != 1:
        raise ValueError(
            "policy.generation.vllm_cfg.tensor_parallel_size: only 1 is supported "
            "(each worker joins the weight-sync group)"
        )
    if cfg.policy.model_name is None:
        raise ValueError("policy.model_name: the vLLM engine loads a model folder; policy.model is torch-only")
    arguments = {
        "model": cfg.policy.model_name,
        "dtype": cfg.policy.dtype,
        "seed": cfg.grpo.seed,
        "worker_extension_cls": WORKER_EXTENSION,
        "logprobs_mode": "processed_logprobs",
        **options,
    }
    return arguments, {str(k): str(v) for k, v in env.items()}


def vllm_sampling(vllm: Any, num_samples: int, decoding: DecodingParams) -> Any:
    """The vllm.SamplingParams of one request; UnsupportedRequest for truncation (see the module's guarantees)."""
    if decoding.top_p < 1.0:
        raise UnsupportedRequest(
            "sampling.top_p: the vLLM engine reports logprobs after truncation; use top_p=1 or the torch engine"
        )
    if decoding.top_k > 0:
        raise UnsupportedRequest(
            "sampling.top_k: the vLLM engine reports logprobs after truncation; use top_k=0 or the torch engine"
        )
    return vllm.SamplingParams(
        n=num_samples,
        temperature=decoding.temperature,
        max_tokens=decoding.max_new_tokens,
        stop=list(decoding.stop) or None,
        include_stop_str_in_output=True,
        ignore_eos=decoding.ignore_eos,
        seed=decoding.seed,
        logprobs=0,  # the sampled token's logprob only
        skip_special_tokens=True,
    )


def completion_from_vllm(output: Any, versions: tuple[int, ...]) -> Completion:
    """A Completion from a vLLM CompletionOutput (token_ids, logprobs, text, finish_reason, stop_reason)."""
    token_ids = [int(t) for t in output.token_ids]
    logprobs = [float(step[token].logprob) for token, step in zip(token_ids, output.logprobs or [], strict=True)]
    if output.finish_reason == "length":
        reason = "length"
    elif isinstance(output.stop_reason, str):
        reason = "stop"
    elif output.finish_reason == "stop":
        reason = "eos"  # the eos token, or a stop token id
    else:
        raise RuntimeError(f"vLLM ended a completion with finish_reason={output.finish_reason!r}")
    return Completion(token_ids, logprobs, output.text, reason, versions)


class VllmEngine(GenerationEngine):
    name = "vllm"

    def __init__(self, llm: Any, vllm: Any, tokenizer: Any, model_name: str, in_flight: bool) -> None:
        self.llm = llm
        self.vllm = vllm
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.in_flight_weight_updates = in_flight
        self._weight_version = 0
        self._applied: list[int] = []  # every version loaded, in order
        self._active = 0
        self._idle = asyncio.Condition()
        self._num_parameters = 0

    @classmethod
    async def create(cls, cfg: MasterConfig, device: str) -> VllmEngine:
        vllm, async_llm = import_vllm()
        try:
            arguments, env = engine_arguments(cfg)
        except ValueError as exc:
            from dockyard.rpc.errors import InvalidArgument

            raise InvalidArgument(str(exc)) from None
        os.environ.update(env)  # vLLM's worker processes inherit this environment
        from transformers import AutoTokenizer

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.policy.model_name)
        llm = async_llm.from_engine_args(vllm.AsyncEngineArgs(**arguments))
        engine = cls(llm, vllm, tokenizer, cfg.policy.model_name or "", cfg.grpo.async_grpo.in_flight_weight_updates)
        counts = await llm.collective_rpc("dockyard_num_parameters")
        engine._num_parameters = int(counts[0]) if counts else 0
        return engine

    # -- GenerationEngine -------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)
        self._applied.append(int(version))

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {}  # the weights live in vLLM's worker processes

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def model_name(self) -> str:
        return self._model_name

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield  # loads go through receive_weights, which waits for generations itself

    async def generate(self, prompt: str, num_samples: int, decoding: DecodingParams) -> GenerationResult:
        prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        if not prompt_ids:
            raise UnsupportedRequest("prompt: tokenizes to no tokens")
        params = vllm_sampling(self.vllm, num_samples, decoding)
        async with self._idle:
            self._active += 1
        start_version, applied_before = self._weight_version, len(self._applied)
        try:
            final = None
            async for output in self.llm.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id=f"dockyard-{uuid.uuid4().hex}"
            ):
                final = output
        finally:
            async with self._idle:
                self._active -= 1
                self._idle.notify_all()
        if final is None:
            raise RuntimeError("vLLM returned no output for a request")
        versions = tuple([start_version, *self._applied[applied_before:]])
        completions = [completion_from_vllm(o, versions) for o in final.outputs]
        return GenerationResult(prompt_token_ids=prompt_ids, completions=completions, weight_version=start_version)

    async def receive_weights(
        self, transport: Transport, version: int, group: WeightSyncGroup | None, timeout: timedelta
    ) -> SyncReport:
        if not self.in_flight_weight_updates:
            async with self._idle:
                await self._idle.wait_for(lambda: self._active == 0)
        args = (transport.spec(), version, asdict(group) if group else None)
        try:
            # Bounded twice: every wait inside the workers, and this call.
            replies = await self.llm.collective_rpc(
                "dockyard_receive", timeout=timeout.total_seconds() * 2 + 30, args=args
            )
        except Exception as exc:  # noqa: BLE001 - any worker failure fails the sync
            with contextlib.suppress(Exception):
                await self.llm.collective_rpc("dockyard_reset", timeout=30)
            raise SyncFailed(f"vLLM workers failed to load version {version}: {exc}") from exc
        self.set_weight_version(version)
        await self.prepare_for_generation()
        first = replies[0]
        return SyncReport(first["checksum"], int(first["num_bytes"]), float(first["seconds"]))

    async def prepare_for_generation(self) -> None:
        await self.llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights

    async def close(self) -> None:
        self.llm.shutdown()
