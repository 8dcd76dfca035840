"""SGLang's offline Engine behind the GenerationEngine interface; SGLang is imported only when a job asks for it.

    LoadPolicy(backend=sglang) ──worker thread: import sglang (SglangUnavailable if missing)──>
        sglang.Engine(model_path, dtype, random_seed, sglang_cfg...)
    generate ──text: our tokenizer / ids: as given──> Engine.async_generate(input_ids=[ids] × n,
        sampling_params=[...] × n, return_logprob=True) ──meta_info──> Completions
    receive_weights ──whole-tensor protocol (sglang_weights.py)──> init_weights_update_group (once per
        epoch) ──> update_weights_from_distributed (once per bucket) ──> "loaded" acknowledgement

Guarantees (by construction against SGLang 0.5's documented Engine API; SGLang
cannot be installed where dockyard's CI runs, so this engine is exercised there
only against a stand-in module, never against SGLang itself):
- prompts are text (tokenized here with the model folder's tokenizer, the
  one SGLang loads) or token ids passed as `input_ids` untouched; an id outside
  the tokenizer's vocabulary is UnsupportedRequest ("prompt_token_ids: ...").
  Any other prompt, images and other multimodal inputs included, is
  UnsupportedRequest ("prompt: ..."): nothing is ever passed as `image_data`;
- logprobs follow the engine convention: SGLang's sampler divides the logits
  by the temperature, takes the softmax and returns the log of those
  probabilities at the sampled token (log_softmax of the raw logits when
  greedy), i.e. after temperature and before truncation. The engine sets
  SGLANG_RETURN_ORIGINAL_LOGPROB=false (which would return pre-temperature
  logprobs), sends top_p=1, top_k=-1, min_p=0 and no penalties explicitly (so
  the model's generation_config defaults never apply), and refuses top_p < 1
  and top_k > 0 (UnsupportedRequest naming the field), as the vLLM engine does;
- top_logprobs > 0 is UnsupportedRequest ("top_logprobs: the SGLang engine
  ..."): SGLang's `top_logprobs_num` exists, but its values cannot be checked
  against the sampled logprobs' law where CI runs, so none are reported;
- a seed is honoured only with sglang_cfg.enable_deterministic_inference
  (SGLang ignores per-request seeds otherwise): without it a seeded request is
  UnsupportedRequest ("sampling.seed"). Sample i of a seeded request uses a
  seed derived from (seed, i), so the samples of one group differ;
- a stop string is kept (no_stop_trim); `text` is our decode of exactly the
  returned token ids (special tokens skipped); finish reasons map to "eos"
  (a matched token id), "stop" (a matched string) and "length"; anything
  else (an abort) is an error, never a guess;
- weights change only between generations: a load waits until no generation
  runs and holds new ones off, so every completion has one weight version.
  In-flight weight updates are refused at load (SGLang's weight update waits
  for every running request), naming grpo.async_grpo.in_flight_weight_updates;
- cancelling a generate task cancels SGLang's request coroutine, which aborts
  the request in SGLang's scheduler.

Weight sync (cluster.weight_sync_transport=collective only; the checkpoint
transport is refused at load): SGLang receives each tensor as one whole
broadcast from rank 0 of a group it forms itself, so the job speaks the
whole-tensor protocol (dockyard/weights/whole_tensor.py; the trainer's side
is chosen by transport_for from policy.generation.backend) instead of
dockyard's packed buckets. This side of it is sglang_weights.py; what it
lacks (a digest of the bytes received, a layout check before bytes move, a
bound on SGLang's own waits) is stated there and in docs/rollout.md#sglang.
Importing SGLang installs uvloop's event-loop policy process-wide (loops made
later; the running one is unaffected).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from datetime import timedelta
from typing import Any

from dockyard.config import MasterConfig
from dockyard.weights.group import SyncFailed, SyncReport, WeightSyncGroup
from dockyard.weights.transport import Transport
from dockyard.weights.whole_tensor import WholeTensorTransport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import Completion, GenerationResult, Prompt, UnsupportedRequest
from services.rollout.out_of_process import (
    OutOfProcessEngine,
    checked_arguments,
    image_refusal,
    outside_vocabulary,
    prompt_ids,
)
from services.rollout.sglang_weights import SglangWeights

# Set by the engine itself; an sglang_cfg that sets them would break the guarantees above.
ENGINE_OWNED = ("model_path", "tokenizer_path", "skip_tokenizer_init", "dtype", "random_seed")
SINGLE = ("tp_size", "dp_size", "pp_size")


class SglangUnavailable(RuntimeError):
    """SGLang cannot be imported on this replica."""


def import_sglang() -> tuple[Any, Any]:
    """(the sglang module, sglang.srt.managers.io_struct), or SglangUnavailable with what to do."""
    try:
        import sglang
        from sglang.srt.managers import io_struct
    except ImportError as exc:
        raise SglangUnavailable(
            "policy.generation.backend=sglang: SGLang is not importable on this rollout replica "
            f"({exc}); `pip install sglang` there (a CUDA GPU node) or use policy.generation.backend=torch"
        ) from None
    return sglang, io_struct


def engine_arguments(cfg: MasterConfig) -> dict[str, Any]:
    """sglang.Engine keyword arguments (server arguments) from the job config; ValueError names the field."""
    options = dict(cfg.policy.generation.sglang_cfg)
    owned = [key for key in ENGINE_OWNED if key in options]
    if owned:
        raise ValueError(f"policy.generation.sglang_cfg: {', '.join(owned)} is set by the engine; remove it")
    for key in SINGLE:
        if int(options.get(key, 1)) != 1:
            raise ValueError(
                f"policy.generation.sglang_cfg.{key}: only 1 is supported (one scheduler joins the weight-sync group)"
            )
    if cfg.policy.model_name is None:
        raise ValueError("policy.model_name: the SGLang engine loads a model folder; policy.model is torch-only")
    if cfg.cluster.weight_sync_transport != "collective":
        raise ValueError(
            "cluster.weight_sync_transport: the SGLang engine receives weights over the weight-sync group only; "
            "set it to collective"
        )
    if cfg.grpo.async_grpo.in_flight_weight_updates:
        raise ValueError(
            "grpo.async_grpo.in_flight_weight_updates: the SGLang engine loads weights only between generations "
            "(SGLang's weight update waits for running requests); set it to false or use the torch or vLLM engine"
        )
    return {"model_path": cfg.policy.model_name, "dtype": cfg.policy.dtype, "random_seed": cfg.grpo.seed, **options}


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed`: distinct per sample, stable across runs."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # within SGLang's signed 64-bit range


def sglang_sampling(decoding: DecodingParams, num_samples: int, deterministic: bool) -> list[dict[str, Any]]:
    """SGLang sampling_params of each sample; UnsupportedRequest for what the module's guarantees refuse."""
    if decoding.top_p < 1.0:
        raise UnsupportedRequest(
            "sampling.top_p: the SGLang engine cannot vouch for logprobs under truncation; "
            "use top_p=1 or the torch engine"
        )
    if decoding.top_k > 0:
        raise UnsupportedRequest(
            "sampling.top_k: the SGLang engine cannot vouch for logprobs under truncation; "
            "use top_k=0 or the torch engine"
        )
    if decoding.top_logprobs:
        raise UnsupportedRequest(
            "top_logprobs: the SGLang engine does not report alternatives (SGLang's top_logprobs_num could not "
            "be checked against the law of the sampled logprobs here); send 0 or use the torch or vLLM engine"
        )
    if decoding.seed is not None and not deterministic:
        raise UnsupportedRequest(
            "sampling.seed: SGLang honours per-request seeds only with "
            "policy.generation.sglang_cfg.enable_deterministic_inference=true; drop the seed or enable it"
        )
    base = {
        "temperature": decoding.temperature,  # 0: SGLang samples greedily
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_new_tokens": decoding.max_new_tokens,
        "stop": list(decoding.stop) or None,
        "no_stop_trim": True,
        "ignore_eos": decoding.ignore_eos,
        "skip_special_tokens": True,
    }
    if decoding.seed is None:
        return [dict(base) for _ in range(num_samples)]
    return [{**base, "sampling_seed": sample_seed(decoding.seed, i)} for i in range(num_samples)]


def completion_from_sglang(output: dict[str, Any], tokenizer: Any, versions: tuple[int, ...]) -> Completion:
    """A Completion from one async_generate result (output_ids, meta_info.output_token_logprobs, finish_reason)."""
    meta = output["meta_info"]
    steps = meta.get("output_token_logprobs") or []
    token_ids = [int(t) for t in output.get("output_ids", [step[1] for step in steps])]
    if [int(step[1]) for step in steps] != token_ids:
        raise RuntimeError("SGLang returned logprobs that do not line up with its output token ids")
    reason = meta.get("finish_reason") or {}
    kind, matched = reason.get("type"), reason.get("matched")
    if kind == "length":
        finish = "length"
    elif kind == "stop" and isinstance(matched, str):
        finish = "stop"
    elif kind == "stop":
        finish = "eos"  # a matched token id: eos (dockyard sends no stop token ids)
    else:
        raise RuntimeError(f"SGLang ended a completion with finish_reason={reason!r}")
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return Completion(token_ids, [float(step[0]) for step in steps], text, finish, versions)


class SglangEngine(OutOfProcessEngine):
    name = "sglang"

    def __init__(self, engine: Any, io_struct: Any, tokenizer: Any, model_name: str, deterministic: bool) -> None:
        self.engine = engine
        self.io_struct = io_struct
        self.tokenizer = tokenizer
        self._model_name = model_name
        self.deterministic = deterministic
        self._vocab = len(tokenizer)
        self._weight_version = 0
        self._active = 0
        self._loading = False
        self._gate = asyncio.Condition()
        self.weights = SglangWeights(engine, io_struct)

    @classmethod
    async def create(cls, cfg: MasterConfig, device: str) -> SglangEngine:
        arguments = checked_arguments(engine_arguments, cfg)

        def start() -> tuple[Any, Any, Any]:
            sglang, io_struct = import_sglang()  # heavy: kept off the event loop
            from transformers import AutoTokenizer

            remote = bool(arguments.get("trust_remote_code", False))  # as SGLang loads it
            tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name, trust_remote_code=remote)
            os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"  # the scheduler inherits it
            return sglang.Engine(**arguments), io_struct, tokenizer

        engine, io_struct, tokenizer = await asyncio.to_thread(start)
        deterministic = bool(arguments.get("enable_deterministic_inference", False))
        return cls(engine, io_struct, tokenizer, cfg.policy.model_name or "", deterministic)

    # -- GenerationEngine -------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)

    @property
    def num_parameters(self) -> int:
        return 0  # SGLang's API does not report it

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def image_refusal(self) -> str:
        return image_refusal("SGLang", "(nothing is passed as SGLang's image_data)")

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids to generate from; UnsupportedRequest for ids outside the vocabulary or any other kind of prompt."""
        return prompt_ids(self, prompt, self._token_ids)

    def _token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise UnsupportedRequest("prompt_token_ids: no tokens")
            outside = outside_vocabulary(prompt, self._vocab)
            if outside:
                raise UnsupportedRequest(
                    f"prompt_token_ids: {outside[:5]} outside the vocabulary of {self._vocab} tokens"
                )
            return list(prompt)
        raise UnsupportedRequest(
            f"prompt: the SGLang engine takes text or token ids, not {type(prompt).__name__}; "
            "image and other multimodal inputs are refused, never dropped"
        )

    async def generate(self, prompt: Prompt, num_samples: int, decoding: DecodingParams) -> GenerationResult:
        prompt_ids = self.prompt_ids(prompt)
        params = sglang_sampling(decoding, num_samples, self.deterministic)
        async with self._gate:
            await self._gate.wait_for(lambda: not self._loading)
            self._active += 1
            version = self._weight_version
        try:
            outputs = await self.engine.async_generate(
                input_ids=[list(prompt_ids) for _ in range(num_samples)], sampling_params=params, return_logprob=True
            )
        except ValueError as exc:  # SGLang's request validation: the prompt (e.g. beyond the context length)
            raise UnsupportedRequest(f"prompt: SGLang refused the request: {exc}") from None
        finally:
            async with self._gate:
                self._active -= 1
                self._gate.notify_all()
        outputs = [outputs] if isinstance(outputs, dict) else list(outputs)
        if len(outputs) != num_samples:
            raise RuntimeError(f"SGLang returned {len(outputs)} completions for {num_samples} samples")
        completions = [completion_from_sglang(o, self.tokenizer, (version,)) for o in outputs]
        return GenerationResult(prompt_token_ids=prompt_ids, completions=completions, weight_version=version)

    async def receive_weights(
        self, transport: Transport, version: int, group: WeightSyncGroup | None, timeout: timedelta
    ) -> SyncReport:
        if not isinstance(transport, WholeTensorTransport) or group is None:
            raise SyncFailed(
                "the SGLang engine loads weights over the weight-sync group only: "
                "set cluster.weight_sync_transport=collective"
            )
        async with self._gate:
            self._loading = True
            await self._gate.wait_for(lambda: self._active == 0)
        try:
            report = await self.weights.load(group, version, timeout)
            self.set_weight_version(version)
        finally:
            async with self._gate:
                self._loading = False
                self._gate.notify_all()
        await self.prepare_for_generation()
        return report

    async def prepare_for_generation(self) -> None:
        pass  # SGLang flushed its prefix cache with the last bucket of the load

    async def close(self) -> None:
        await self.weights.leave()
        await asyncio.to_thread(self.engine.shutdown)
