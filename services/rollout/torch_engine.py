"""The built-in generation engine: transformers' `generate` on the job's policy, in this process.

    prompt ──tokenize──> prompt ids ──repeat × num_samples──> model.generate (one batch, KV cache)
        ──> per row: cut after eos / stop string ──> GenerationResult(completions, weight_version)

Guarantees: those of every engine (services/rollout/engine.py), and: transformers' own batched
`generate` with its static KV cache (`kv_cache="static"`; on CUDA transformers compiles the forward
for it) or its default dynamic cache; generation runs in a worker thread, never on the event loop;
all TorchEngines of a process generate one at a time (the torch RNG is process-global, and a seeded
request must not be perturbed by a concurrent one); a cancelled `generate` stops its worker at the
next decode step (GenerationCancelled, no result), releasing the lock for the next request. The same
seed, prompt, num_samples and decoding parameters give the same completions on the same device and
weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from services.rollout.decoding import DecodingParams
from services.rollout.engine import (
    Completion,
    GenerationCancelled,
    GenerationEngine,
    GenerationResult,
    UnsupportedRequest,
)

log = structlog.get_logger()
# One lock for every TorchEngine of the process: seeding goes through the
# global torch RNG, so generations must not interleave.
_GENERATION_LOCK = threading.Lock()
# And one thread that runs them all: CUDA graphs captured by a compiled static-cache
# forward keep their state in the capturing thread, so a replay from another thread fails.
_GENERATION_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dockyard-generate")


class _SampledLogprobs(LogitsProcessor):
    """Records log_softmax(raw_logits / T) at each sampled token, holding one step's distribution at a time.

    It must see the raw logits: TorchEngine gives the model a neutral
    generation config, so no processor runs before this one, and the
    temperature / top-k / top-p warpers run after it.
    """

    def __init__(self, temperature: float) -> None:
        self.inv_temperature = 1.0 / temperature if temperature > 0 else 1.0
        self.previous: torch.Tensor | None = None  # (batch, vocab) log-probs of the last step
        self.steps: list[torch.Tensor] = []  # (batch,) log-prob of each sampled token

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.previous is not None
        return self.previous.gather(1, tokens.view(-1, 1).to(self.previous.device)).squeeze(1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # input_ids now ends with the token sampled from the previous step's distribution.
        if self.previous is not None:
            self.steps.append(self._gather(input_ids[:, -1]))
        self.previous = torch.log_softmax(scores.float() * self.inv_temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """(batch, steps) logprobs of `generated`, the new tokens that generate() returned."""
        n = generated.shape[1]
        # generate() may compute a step past the end and undo it; keep only returned steps.
        steps = self.steps[:n]
        if len(steps) < n:
            steps.append(self._gather(generated[:, len(steps)]))
        self.previous = None
        return torch.stack(steps, dim=1)


class _WeightGate:
    """Generation holds the weights while it computes; an in-flight update takes them between two decode steps.

    A waiting update has priority: a generation passing `checkpoint()` lets it
    through, and no generation starts while one waits.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._writer = False
        self._writers_waiting = 0

    def _enter(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._active += 1

    def _exit(self) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def checkpoint(self) -> bool:
        """Between decode steps: let a waiting update load; True if one did."""
        with self._cv:
            if not self._writers_waiting:
                return False
        self._exit()
        self._enter()
        return True

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        with self._cv:
            self._writers_waiting += 1
            self._cv.wait_for(lambda: self._active == 0 and not self._writer)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cv:
                self._writer = False
                self._cv.notify_all()


class _StepVersions(LogitsProcessor):
    """Records the weight version of each sampled token and is the step boundary where in-flight updates land.

    It runs after the step's forward pass: the token sampled from these scores
    comes from the weights loaded now; an update let through here changes the
    weights for the next step's forward pass only.
    """

    def __init__(self, engine: TorchEngine, in_flight: bool) -> None:
        self.engine = engine
        self.in_flight = in_flight
        self.steps: list[int] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps.append(self.engine.weight_version)
        if self.in_flight:
            self.engine._gate.checkpoint()
        return scores


class _StopHits(StoppingCriteria):
    """Stops a row at the first token that completes a stop string, and remembers where.

    transformers' StopStringCriteria does the matching (a token that runs past
    the stop string counts). It sees only the completion, so a stop string
    that straddles the end of the prompt does not end a completion at its
    first token, and special tokens are hidden from it, as they are from
    the completion's text, so "<pad>" does not complete the stop string "a".
    """

    def __init__(self, tokenizer: Any, stops: list[str], prompt_len: int, device: torch.device) -> None:
        try:
            self.matcher = StopStringCriteria(tokenizer, stops)
        except ValueError:  # no token sequence can produce a stop string
            raise UnsupportedRequest(f"sampling.stop: no token sequence of this tokenizer produces {stops!r}") from None
        self.prompt_len = prompt_len
        self.special_ids = torch.tensor(sorted(tokenizer.all_special_ids), dtype=torch.long, device=device)
        # The matcher's last embedding row is a dummy that matches nothing.
        self.no_match_id = self.matcher.embedding_vec.size(0) - 1
        self.steps: list[torch.Tensor] = []  # (batch,) bool per generated token

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        ids = input_ids[:, self.prompt_len :]
        ids = torch.where(torch.isin(ids, self.special_ids), self.no_match_id, ids)
        done = self.matcher(ids, scores)
        self.steps.append(done)
        return done

    def finish(self, num_steps: int) -> list[list[bool]]:
        return torch.stack(self.steps[:num_steps], dim=1).cpu().tolist()


class _Cancelled(StoppingCriteria):
    """Ends every row at the next decode step once `event` is set, and counts the steps taken."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self.steps += 1
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class TorchEngine(GenerationEngine):
    """Hugging Face `generate` on a causal LM: the whole group in one batch with a KV cache."""

    name = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | torch.device = "cpu",
        *,
        model_name: str = "",
        kv_cache: str = "dynamic",
        in_flight_weight_updates: bool = False,
    ) -> None:
        if kv_cache not in ("static", "dynamic"):
            raise ValueError(f"kv_cache must be static or dynamic, not {kv_cache!r}")
        self.kv_cache = kv_cache
        self.in_flight_weight_updates = in_flight_weight_updates
        self._gate = _WeightGate()
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self._model_name = model_name or getattr(model.config, "name_or_path", "") or model.config.model_type
        self._weight_version = 0
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
        # A checkpoint's generation_config.json (repetition penalty, top_k, ...)
        # would change the sampling distribution behind the reported logprobs;
        # every control comes from DecodingParams instead.
        self.model.generation_config = GenerationConfig(
            pad_token_id=self.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=None
        )

    # -- GenerationEngine -------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Parameters by `named_parameters()` name (tied weights once); copy_ into them under no_grad."""
        return {name: p.data for name, p in self.model.named_parameters()}

    @property
    def model_name(self) -> str:
        return self._model_name

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the weights still for an update (blocking: call from a worker thread).

        Without in-flight updates it waits until no generation of the process
        runs; with them, only until the running generation reaches its next
        decode step, which then waits for the update.
        """
        if self.in_flight_weight_updates:
            with self._gate.updating():
                yield
        else:
            with _GENERATION_LOCK, self._gate.updating():
                yield

    @property
    def context_tokens(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def tokenize(self, prompt: str) -> list[int]:
        # The tokenizer's own convention (a BOS where the model expects one); the
        # ids go back with the result, so the trainer never re-tokenizes.
        return list(self.tokenizer(prompt)["input_ids"])

    async def generate(self, prompt: str, num_samples: int, decoding: DecodingParams) -> GenerationResult:
        cancel = threading.Event()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                _GENERATION_THREAD, self.generate_blocking, prompt, num_samples, decoding, cancel
            )
        except asyncio.CancelledError:
            cancel.set()  # a queued call never starts; a running one stops at its next decode step
            raise

    # -- the work, in a worker thread --------------------------------------

    def generate_blocking(
        self, prompt: str, num_samples: int, decoding: DecodingParams, cancel: threading.Event | None = None
    ) -> GenerationResult:
        """The generation itself; GenerationCancelled once `cancel` is set."""
        cancel = cancel or threading.Event()
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise UnsupportedRequest("prompt: tokenizes to no tokens")
        with _GENERATION_LOCK, self._gate.computing():
            if decoding.seed is None:
                generated, logprobs, stops, versions = self._sample(prompt_ids, num_samples, decoding, cancel)
            else:
                devices = [self.device] if self.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(decoding.seed)
                    generated, logprobs, stops, versions = self._sample(prompt_ids, num_samples, decoding, cancel)
        completions = [
            self._finish_row(generated[i], logprobs[i], stops[i], versions, decoding) for i in range(num_samples)
        ]
        oldest = min(min(c.weight_versions) for c in completions)
        return GenerationResult(prompt_token_ids=prompt_ids, completions=completions, weight_version=oldest)

    @torch.inference_mode()
    def _sample(
        self, prompt_ids: list[int], num_samples: int, decoding: DecodingParams, cancel: threading.Event
    ) -> tuple[list, list, list, list[int]]:
        """(new tokens, their logprobs, stop-string hits) per row, padding after a finished row included,
        and the weight version of each step."""
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device).repeat(num_samples, 1)
        recorder = _SampledLogprobs(decoding.temperature)
        step_versions = _StepVersions(self, self.in_flight_weight_updates)
        cancelled = _Cancelled(cancel)
        criteria = StoppingCriteriaList([cancelled])
        stop_hits = None
        if decoding.stop:
            stop_hits = _StopHits(self.tokenizer, list(decoding.stop), len(prompt_ids), self.device)
            criteria.append(stop_hits)
        # Static: one preallocated cache that transformers reuses (and compiles for on CUDA);
        # its length only grows, so later calls of the same or smaller size compile nothing new.
        cache: dict[str, Any] = {"cache_implementation": "static"} if self.kv_cache == "static" else {}
        warpers: dict[str, Any] = {}
        if not decoding.greedy:
            warpers = {"temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": decoding.top_k}
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=not decoding.greedy,
            max_new_tokens=decoding.max_new_tokens,
            eos_token_id=None if decoding.ignore_eos else (self.eos_token_ids or None),
            pad_token_id=self.pad_token_id,
            # The recorder first: it must see the raw logits.
            logits_processor=LogitsProcessorList([recorder, step_versions]),
            stopping_criteria=criteria,
            return_dict_in_generate=True,
            use_cache=True,
            **cache,
            **warpers,
        )
        if cancel.is_set():  # rows cut short by the cancellation are no result
            log.info("generation cancelled", decode_steps=cancelled.steps, max_new_tokens=decoding.max_new_tokens)
            raise GenerationCancelled(cancelled.steps)
        generated = out.sequences[:, len(prompt_ids) :]
        logprobs = recorder.finish(generated).float().cpu().tolist()
        hits = stop_hits.finish(generated.shape[1]) if stop_hits is not None else [[] for _ in range(num_samples)]
        versions = step_versions.steps[: generated.shape[1]]
        versions += [self._weight_version] * (generated.shape[1] - len(versions))
        return generated.tolist(), logprobs, hits, versions

    def _finish_row(
        self,
        tokens: list[int],
        logprobs: list[float],
        stop_hits: list[bool],
        step_versions: list[int],
        decoding: DecodingParams,
    ) -> Completion:
        end, reason = len(tokens), "length"
        if not decoding.ignore_eos:
            eos = set(self.eos_token_ids)
            for i, token in enumerate(tokens):
                if token in eos:
                    end, reason = i + 1, "eos"
                    break
        # Special tokens never complete a stop string, so a hit always lies before an eos.
        for i in range(min(end, len(stop_hits))):
            if stop_hits[i]:
                end, reason = i + 1, "stop"
                break
        kept = tokens[:end]
        if reason == "length" and len(kept) < decoding.max_new_tokens:
            # generate() ends a row early only at eos or a stop string: anything else is a bug here.
            raise RuntimeError(f"row ended after {len(kept)} tokens without eos or stop string")
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        versions = tuple(sorted(set(step_versions[:end]))) or (self._weight_version,)
        return Completion(kept, logprobs[:end], text, reason, versions)
