"""The torch engine's path for prompts with images: a vision-language policy, one request at a time.

    ImagePrompt(text, RGB images) ──processor (inserts the image tokens)──> input ids + pixel values
        ──one prefill (vision tower + LM)──> KV cache × num_samples rows
        ──decode step: sample() per row──> cut at eos / stop string / length ──> GenerationResult

Guarantees: a prompt whose ids (image tokens included) plus max_new_tokens exceed the language
model's context is UnsupportedRequest before the model runs. Sampling and logprobs are the decode
batch's (sampling.sample: log_softmax(logits / T) at the chosen token, alternatives when
top_logprobs asks, seeded rows reproducible), and so are the ends (eos kept unless ignore_eos,
stop strings, max_new_tokens); `prompt_token_ids`
are exactly the ids the model saw, image tokens included, so what comes back is token-faithful.
The weights are held still for the whole generation (weight_gate.WeightGate, as one long decode
step), so every token of a result comes from one weight version. Cancellation is seen between
decode steps. Image requests do not join the text decode batch (its slotted cache takes token ids
only); they run beside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from services.rollout.decoding import DecodingParams
from services.rollout.engine import (
    Completion,
    GenerationCancelled,
    GenerationResult,
    ImagePrompt,
    TopLogprobs,
    UnsupportedRequest,
)
from services.rollout.sampling import StopStrings, sample
from services.rollout.weight_gate import WeightGate


class ImageGenerator:
    """Generates from ImagePrompt with a transformers image-text-to-text model and its processor."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        device: torch.device,
        eos_token_ids: list[int],
        gate: WeightGate,
        weight_version: Callable[[], int],
    ) -> None:
        self.model, self.processor, self.device = model, processor, device
        self.tokenizer = processor.tokenizer
        self.eos = set(eos_token_ids)
        self.gate = gate
        self.weight_version = weight_version
        self.image_token = getattr(processor, "image_token", None)

    def inputs(self, prompt: ImagePrompt) -> dict[str, torch.Tensor]:
        """The processor's tensors for one prompt; placeholders are prepended when the text has none."""
        text = prompt.text
        if self.image_token:
            found = text.count(self.image_token)
            if found == 0:
                text = self.image_token * len(prompt.images) + text
            elif found != len(prompt.images):
                raise UnsupportedRequest(
                    f"prompt: {found} {self.image_token} placeholder(s) for {len(prompt.images)} image(s); "
                    "give one per image, or none to have them put first"
                )
        try:
            encoded = self.processor(text=[text], images=list(prompt.images), return_tensors="pt")
        except (ValueError, TypeError) as exc:
            raise UnsupportedRequest(f"images: the model's processor refused them: {exc}") from None
        return {k: v.to(self.device) for k, v in encoded.items()}

    def generate(
        self,
        prompt: ImagePrompt,
        params: DecodingParams,
        generators: list[torch.Generator],
        cancel: threading.Event,
    ) -> GenerationResult:
        """num_samples = len(generators) completions; blocking (call from a worker thread)."""
        inputs = self.inputs(prompt)
        prompt_ids = inputs["input_ids"][0].tolist()
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and len(prompt_ids) + params.max_new_tokens > context:
            raise UnsupportedRequest(
                f"prompt is {len(prompt_ids)} tokens with its image tokens; with max_new_tokens "
                f"{params.max_new_tokens} that exceeds the model's context of {context} tokens"
            )
        stops = StopStrings(self.tokenizer, params.stop) if params.stop else None
        n = len(generators)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[TopLogprobs]] = [[] for _ in range(n)]
        reasons = [""] * n
        self.gate.enter()
        try:
            version = self.weight_version()
            with torch.inference_mode():
                out = self.model(**inputs, use_cache=True)
                cache = out.past_key_values
                cache.batch_repeat_interleave(n)
                logits = out.logits[:, -1].expand(n, -1)
                mask = inputs["attention_mask"].expand(n, -1)
                for step in range(params.max_new_tokens):
                    if cancel.is_set():
                        raise GenerationCancelled(step)
                    drawn = sample(logits, [params] * n, generators)
                    chosen = drawn.tokens
                    steps = (chosen.tolist(), drawn.logprobs.tolist(), drawn.top_lists([params] * n))
                    self._record(*steps, tokens, logprobs, tops, reasons, params, stops)
                    if all(reasons):
                        break
                    mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                    out = self.model(
                        input_ids=chosen[:, None], attention_mask=mask, past_key_values=cache, use_cache=True
                    )
                    cache, logits = out.past_key_values, out.logits[:, -1]
        finally:
            self.gate.exit()
        completions = [
            Completion(t, lp, self.tokenizer.decode(t, skip_special_tokens=True), r, (version,), top)
            for t, lp, r, top in zip(tokens, logprobs, reasons, tops, strict=True)
        ]
        return GenerationResult(prompt_token_ids=prompt_ids, completions=completions, weight_version=version)

    def _record(self, chosen, picked, top, tokens, logprobs, tops, reasons, params, stops) -> None:
        """Append each unfinished row's token (and its alternatives, if asked), then mark the rows it ends."""
        live = [i for i, r in enumerate(reasons) if not r]
        for i in live:
            tokens[i].append(int(chosen[i]))
            logprobs[i].append(float(picked[i]))
            if top[i] is not None:
                tops[i].append(top[i])
        hits = stops.hits([tokens[i] for i in live]) if stops is not None else [False] * len(live)
        for i, hit in zip(live, hits, strict=True):
            if not params.ignore_eos and tokens[i][-1] in self.eos:
                reasons[i] = "eos"
            elif hit:
                reasons[i] = "stop"
            elif len(tokens[i]) >= params.max_new_tokens:
                reasons[i] = "length"
