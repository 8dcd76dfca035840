"""The built-in generation engine: the job's policy in this process, every concurrent request in one decode batch.

    generate(prompt, n) ──tokenize text / check ids──> Request(n rows) ──submit──> DecodeBatch (scheduler thread)
        rows join the running batch between decode steps ──> each row leaves at eos / stop string / length
        ──> GenerationResult(completions, weight_version) once the request's last row left
    generate_stream: the same request, each step's new tokens handed to the caller's loop as they are sampled

Guarantees: those of every engine (services/rollout/engine.py), and: concurrent `generate` calls
share one decode batch (services/rollout/decode_batch.py; at most `max_batch_rows` rows, the rest
wait and join as rows leave), over a preallocated slotted KV cache (services/rollout/kv_slots.py);
on CUDA with kv_cache "static" (or "auto") the decode step is compiled (torch.compile; unless
`compile_decode` is False) and replayed from captured CUDA graphs, "dynamic" runs it eagerly
(always so on CPU); the event loop never waits on the model. Every row
samples with its own parameters and generator: a seeded request gives the same tokens whatever
else is in the batch (up to floating-point differences between batch shapes, which can flip a
sample that lies on a boundary), an unseeded row draws from the engine's own generator. Weights
load in place into the live parameters, the same tensors for the engine's life (`named_weights`;
with `contiguous_weights`, views of one arena), so a captured graph stays valid. With `prefix_cache_tokens` > 0,
finished rows' KV is kept and a later prompt sharing its prefix prefills only the rest
(services/rollout/prefix_cache.py; reuse within one weight version only). Given a processor (a
vision-language policy), an ImagePrompt runs beside the batch (services/rollout/image_generation.py).
A mixture-of-experts policy (dockyard/models/moe.py) decodes eagerly: kv_cache "static" on CUDA and
precision fp8 are refused with ConfigError, "auto" runs without graphs; every result carries the
experts each position was routed to (services/rollout/decode_batch.py, dockyard/models/routing.py).
`generate_stream` streams per decode step (an ImagePrompt's result comes alone); a request that
does not stream costs the scheduler one attribute check per row and step.

Why over 400 lines: one class holds the whole GenerationEngine contract for the built-in engine (requests,
results with their routing, streaming, weights, the MoE refusals); the scheduling itself already lives in
decode_batch.py, kv_slots.py and prefix_cache.py, and what remains reads top to bottom as one interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig

from dockyard.config import ConfigError
from dockyard.models.moe import moe_family
from dockyard.weights import arena
from dockyard.weights.collective import TensorSink
from services.rollout import fp8
from services.rollout.decode_batch import BatchStats, DecodeBatch, Request, Row
from services.rollout.decoding import DecodingParams
from services.rollout.engine import (
    Completion,
    DeltaSink,
    GenerationEngine,
    GenerationResult,
    HeldDeltas,
    ImagePrompt,
    Prompt,
    TokenDelta,
    UnsupportedRequest,
)
from services.rollout.handoff import LoopHandoff
from services.rollout.image_generation import ImageGenerator
from services.rollout.prefix_cache import PrefixStats
from services.rollout.sampling import StopStrings, row_generator
from services.rollout.weight_gate import WeightGate

DEFAULT_MAX_BATCH_ROWS = 64


class TorchEngine(GenerationEngine):
    """A causal LM of transformers, decoding every concurrent request's rows in one batch."""

    name = "torch"
    streams = True
    captures_routing = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        *,
        model_name: str = "",
        kv_cache: str = "dynamic",
        in_flight_weight_updates: bool = False,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        compile_decode: bool | None = None,
        prefix_cache_tokens: int = 0,
        precision: str = "auto",
        processor: Any = None,
        contiguous_weights: bool = False,
    ) -> None:
        if kv_cache not in ("static", "dynamic", "auto"):
            raise ValueError(f"kv_cache must be static, dynamic or auto, not {kv_cache!r}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        graphs = kv_cache in ("static", "auto")
        if moe_family(model.config) is not None:  # decoded eagerly, or refused (_check_moe)
            _check_moe(kv_cache, precision, torch.device(device))
            graphs = False
        self.kv_cache = kv_cache
        self.in_flight_weight_updates = in_flight_weight_updates
        self.model = model.to(device).eval()
        if contiguous_weights:  # one arena: a colocated refit from a trainer packed alike is one memcpy
            arena.pack(self.model)
        # precision fp8 (fp8_block): the decoder's linear layers run FP8 matmuls, requantized with every load.
        self._fp8: fp8.Fp8Layers | None = None
        if precision in ("fp8", "fp8_block"):
            self._fp8 = fp8.convert(self.model, torch.device(device), block=precision == "fp8_block")
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._model_name = model_name or getattr(model.config, "name_or_path", "") or model.config.model_type
        self._weight_version = 0
        self._weights: dict[str, torch.Tensor] | None = None
        eos = set()
        for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source is not None:
                eos.update(int(t) for t in source)
        self.eos_token_ids: list[int] = sorted(eos)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        # A checkpoint's generation_config.json (repetition penalty, top_k, ...) would change the
        # sampling distribution behind the reported logprobs; every control comes from DecodingParams.
        self.model.generation_config = GenerationConfig(
            pad_token_id=self.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=None
        )
        self.vocab_size = min(len(tokenizer), self.model.get_input_embeddings().num_embeddings)
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()  # unseeded rows: nondeterministic
        self._gate = WeightGate()
        self._loop_handoff: tuple[asyncio.AbstractEventLoop, LoopHandoff] | None = None
        self._batch = DecodeBatch(
            self.model,
            slots=max_batch_rows,
            device=self.device,
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            graphs=graphs,
            compile=graphs if compile_decode is None else compile_decode,
            gate=self._gate,
            weight_version=lambda: self._weight_version,
            in_flight=in_flight_weight_updates,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        # A vision-language policy's processor: ImagePrompts run on their own path beside the batch.
        self._images = None
        if processor is not None:
            self._images = ImageGenerator(
                self.model,
                processor,
                device=self.device,
                eos_token_ids=self.eos_token_ids,
                gate=self._gate,
                weight_version=lambda: self._weight_version,
            )

    # -- GenerationEngine -------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        # Called with the weights held still, right after they loaded: FP8 copies of exactly those.
        if self._fp8 is not None:
            self._fp8.finish()
        self._weight_version = int(version)

    def weight_sink(self) -> TensorSink:
        if self._fp8 is None:
            return super().weight_sink()
        self._fp8.begin()  # each FP8 layer requantized as its weight lands, beside the transfer of the rest
        return TensorSink(targets=self.named_weights(), landed=self._fp8.landed)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters by `named_parameters()` name (tied weights once); copy_ into them under no_grad.

        The same tensors for the engine's life (refits copy into them), so the walk over the modules,
        which costs more than a small model's refit, runs once."""
        if self._weights is None:
            self._weights = {name: p.data for name, p in self.model.named_parameters()}
        return self._weights

    @property
    def model_name(self) -> str:
        return self._model_name

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the weights still for an update (blocking: call from a worker thread).

        Without in-flight updates it waits until the batch has drained (no new request joins
        meanwhile); with them, only until the current decode step ends.
        """
        with self._gate.updating():
            yield

    def exclusive_now(self) -> contextlib.AbstractContextManager[None] | None:
        if self._fp8 is not None:  # requantizing every linear layer after a load is model work: kept off the event loop
            return None
        return self._gate.update_now()

    @property
    def update_waiting(self) -> bool:
        """Whether a weight update is waiting for the decode step to let go of the weights."""
        return self._gate.waiting

    async def close(self) -> None:
        await asyncio.to_thread(self._batch.close)

    @property
    def context_tokens(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def image_refusal(self) -> str | None:
        if self._images is None:
            return (
                f"the policy {self._model_name!r} has no image processor (a text-only model, or "
                "policy.generation.allow_multimodal_inputs was off when it loaded): load a vision-language model"
            )
        return None

    @property
    def batch_stats(self) -> BatchStats:
        """Counters of the decode batch (steps, rows joined, largest batch ...)."""
        return self._batch.stats

    @property
    def kv_cache_stats(self) -> PrefixStats | None:
        """The prefix cache's counters and pressure (services/rollout/prefix_cache.py); None when it is off."""
        return self._batch.prefix_stats if self._batch.prefix is not None else None

    def tokenize(self, prompt: str) -> list[int]:
        # The tokenizer's own convention (a BOS where the model expects one); the
        # ids go back with the result, so the trainer never re-tokenizes.
        return list(self.tokenizer(prompt)["input_ids"])

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A text prompt tokenized, or token ids checked and taken as they are."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
            if not ids:
                raise UnsupportedRequest("prompt: tokenizes to no tokens")
            return ids
        ids = []
        for i, token in enumerate(prompt):
            try:
                ids.append(operator.index(token))
            except TypeError:
                raise UnsupportedRequest(f"prompt_token_ids[{i}]: not an integer: {token!r}") from None
            if not 0 <= ids[-1] < self.vocab_size:
                raise UnsupportedRequest(
                    f"prompt_token_ids[{i}]: {ids[-1]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if not ids:
            raise UnsupportedRequest("prompt_token_ids: empty")
        return ids

    async def generate(self, prompt: Prompt, num_samples: int, decoding: DecodingParams) -> GenerationResult:
        cancel = threading.Event()
        if isinstance(prompt, ImagePrompt):
            return await self._generate_images(prompt, num_samples, decoding, cancel)
        # Tokenizing and preparing stop strings take time on long prompts and large vocabularies: off the loop.
        request = await asyncio.to_thread(self._request, prompt, num_samples, decoding, cancel)
        future = self._batch.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancel.set()  # a queued request never joins; a running one leaves at the next step
            self._batch.wake()
            raise

    async def _generate_images(
        self, prompt: ImagePrompt, num_samples: int, decoding: DecodingParams, cancel: threading.Event
    ) -> GenerationResult:
        if self._images is None:
            raise UnsupportedRequest(f"images: {self.image_refusal}")
        generators = self._generators(decoding, num_samples)
        try:
            return await asyncio.to_thread(self._images.generate, prompt, decoding, generators, cancel)
        except asyncio.CancelledError:
            cancel.set()  # the worker thread stops at its next decode step
            raise

    async def generate_stream(
        self,
        prompt: Prompt,
        num_samples: int,
        decoding: DecodingParams,
        on_deltas: DeltaSink,
        interval: float = 0.0,
    ) -> GenerationResult:
        """Each decode step's new tokens to `on_deltas`, or with `interval` those of the steps since the last
        hand-off, once per interval (HeldDeltas); one wake-up of the loop per hand-off, however many streams
        share it. The step that ends the rows reports nothing: the result holds its tokens, and those held."""
        if isinstance(prompt, ImagePrompt):  # the image path runs beside the batch, not step by step
            return await self.generate(prompt, num_samples, decoding)
        loop = asyncio.get_running_loop()
        handoff = self._handoff(loop)
        # Done on every way out (the result, a failure, on_deltas' error, a cancellation, which cancels it):
        # steps posted before then are dropped.
        settled: asyncio.Future[Future] = loop.create_future()

        def deliver(deltas: list[TokenDelta]) -> None:  # on the loop
            if settled.done():
                return
            try:
                on_deltas(deltas)
            except Exception as exc:  # noqa: BLE001 - the consumer's failure ends this generation, with its error
                settled.set_exception(exc)

        def settle(future: Future) -> None:  # on the loop, after every step the request reported
            if not settled.done():
                settled.set_result(future)

        held = HeldDeltas(interval)  # touched in the scheduler thread only

        def on_tokens(rows: list[Row]) -> None:  # in the scheduler thread
            for r in rows:
                held.add(r.index, [r.tokens[-1]], [r.logprobs[-1]])
            if deltas := held.take():
                handoff.post(deliver, deltas)

        cancel = threading.Event()
        request = await asyncio.to_thread(self._request, prompt, num_samples, decoding, cancel, on_tokens)
        self._batch.submit(request).add_done_callback(lambda future: handoff.post(settle, future))
        try:
            return (await settled).result()  # the result, or GenerationCancelled / the step's error raised
        finally:
            if not request.future.done():  # the consumer went away (cancelled, or on_deltas failed): rows leave
                cancel.set()
                self._batch.wake()

    def _handoff(self, loop: asyncio.AbstractEventLoop) -> LoopHandoff:
        """The scheduler thread's mailbox to `loop`, shared by every stream on it (one wake-up per step)."""
        if self._loop_handoff is None or self._loop_handoff[0] is not loop:
            self._loop_handoff = (loop, LoopHandoff(loop))
        return self._loop_handoff[1]

    def generate_blocking(
        self, prompt: Prompt, num_samples: int, decoding: DecodingParams, cancel: threading.Event | None = None
    ) -> GenerationResult:
        """The same generation, waited for in this thread; GenerationCancelled once `cancel` is set."""
        request = self._request(prompt, num_samples, decoding, cancel or threading.Event())
        return self._batch.submit(request).result()

    # -- requests and results -------------------------------------------------

    def _request(
        self,
        prompt: Prompt,
        num_samples: int,
        decoding: DecodingParams,
        cancel: threading.Event,
        on_tokens: Any = None,
    ) -> Request:
        prompt_ids = self.prompt_ids(prompt)
        stops = StopStrings(self.tokenizer, decoding.stop) if decoding.stop else None
        generators = self._generators(decoding, num_samples)
        rows = [Row(params=decoding, generator=g, index=i) for i, g in enumerate(generators)]
        return Request(
            prompt_ids=prompt_ids, rows=rows, stops=stops, cancel=cancel, resolve=self._result, on_tokens=on_tokens
        )

    def _generators(self, decoding: DecodingParams, num_samples: int) -> list[torch.Generator]:
        """Seeded: one generator per row from (seed, row); unseeded: the engine's own for every row."""
        if decoding.seed is None:
            return [self._generator] * num_samples
        return [row_generator(decoding.seed, i, self.device) for i in range(num_samples)]

    def _result(self, request: Request) -> GenerationResult:
        """Runs in the scheduler thread once every row finished."""
        completions = []
        shape = self._batch.recorder.shape if self._batch.recorder is not None else None
        for row in request.rows:
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            versions = tuple(sorted(row.versions))
            routing = None
            if shape is not None:
                routing = np.stack(row.routing) if row.routing else np.zeros((0, shape.moe_layers, shape.top_k))
                routing = routing.astype(shape.dtype, copy=False)
            completions.append(
                Completion(
                    row.tokens,
                    row.logprobs,
                    text,
                    row.finish_reason,
                    versions,
                    row.top_logprobs,
                    routing,
                    row.prompt_routing,
                )
            )
        oldest = min(min(c.weight_versions) for c in completions)
        return GenerationResult(
            prompt_token_ids=list(request.prompt_ids),
            completions=completions,
            weight_version=oldest,
            prompt_routing=completions[0].prompt_routing,
            routing_shape=shape,
        )


def _check_moe(kv_cache: str, precision: str, device: torch.device) -> None:
    """ConfigError for what a mixture-of-experts policy cannot run here; otherwise its decode step runs eagerly.

    Graphs: transformers' grouped-expert forward falls back, under torch.compile in float32, to a per-expert
    loop that reads the routing counts on the host, which a CUDA graph capture cannot hold, and no graph
    decode of an MoE policy has been checked against eager decode; "auto" decodes eagerly. FP8: the experts'
    3-D weights are no nn.Linear, so only attention would be quantized, and a quantized router would move
    tokens to other experts than the trainer picks.
    """
    if precision != "auto":
        raise ConfigError(f"policy.generation.precision={precision}: not supported for mixture-of-experts policies")
    if kv_cache == "static" and device.type == "cuda":
        raise ConfigError(
            "policy.generation.kv_cache=static: the torch engine captures no CUDA graphs of a mixture-of-experts "
            "decode step (data-dependent expert routing); use dynamic or auto (auto decodes it eagerly)"
        )
