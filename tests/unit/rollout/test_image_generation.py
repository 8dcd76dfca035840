"""The torch engine generating from images with a tiny random-init vision-language policy, loaded from a folder."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from dockyard.config import PolicyConfig
from dockyard.models.load import load_policy, load_processor
from dockyard.models.vision import IMAGE_TOKEN, IMAGE_TOKENS, build_tiny_vlm
from services.rollout.decoding import DecodingParams
from services.rollout.engine import ImagePrompt, UnsupportedRequest
from services.rollout.torch_engine import TorchEngine

RED = Image.new("RGB", (48, 32), (220, 30, 30))
STRIPES = Image.new("RGB", (32, 32), (0, 0, 0))
for x in range(0, 32, 4):
    STRIPES.paste((255, 255, 255), (x, 0, x + 2, 32))


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=3)


@pytest.fixture(scope="module")
def engine(vlm_folder):
    policy = PolicyConfig(model_name=str(vlm_folder), generation={"allow_multimodal_inputs": True})
    model, tokenizer = load_policy(policy)
    processor = load_processor(policy)
    assert processor is not None and type(model).__name__ == "LlavaForConditionalGeneration"
    engine = TorchEngine(model, tokenizer, "cpu", processor=processor, max_batch_rows=4)
    yield engine
    asyncio.run(engine.close())


def _recomputed_logprobs(engine, result, completion, image) -> list[float]:
    """log_softmax at each sampled token from one full forward over prompt + completion with `image`."""
    processor = engine._images.processor
    pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([result.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids, pixel_values=pixels).logits[0].float()
    start = len(result.prompt_token_ids)
    logprobs = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1).tolist()


def test_the_engine_generates_from_an_image_token_faithfully(engine) -> None:
    decoding = DecodingParams(temperature=1.0, max_new_tokens=6, seed=11, ignore_eos=True)
    prompt = ImagePrompt(text="f(x)=", images=(RED,))
    result = asyncio.run(engine.generate(prompt, 3, decoding))
    image_id = engine.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    # The processor inserted the image's tokens in front of the text; they come back as the model saw them.
    assert result.prompt_token_ids[:IMAGE_TOKENS] == [image_id] * IMAGE_TOKENS
    assert engine.tokenizer.decode(result.prompt_token_ids[IMAGE_TOKENS:]) == "f(x)="
    assert len(result.completions) == 3 and result.weight_version == 0
    for completion in result.completions:
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        again = _recomputed_logprobs(engine, result, completion, RED)
        assert completion.logprobs == pytest.approx(again, abs=1e-4)
        # The image matters: another image gives the same tokens other logprobs.
        other = _recomputed_logprobs(engine, result, completion, STRIPES)
        assert max(abs(a - b) for a, b in zip(other, again, strict=True)) > 1e-4
    same = asyncio.run(engine.generate(prompt, 3, decoding))
    assert [c.token_ids for c in same.completions] == [c.token_ids for c in result.completions]


def test_image_prompts_report_top_logprobs_under_the_same_law(engine) -> None:
    decoding = DecodingParams(temperature=1.0, max_new_tokens=4, seed=5, ignore_eos=True, top_logprobs=3)
    result = asyncio.run(engine.generate(ImagePrompt(text="f(x)=", images=(RED,)), 2, decoding))
    processor = engine._images.processor
    pixels = processor.image_processor(images=[RED], return_tensors="pt")["pixel_values"]
    for completion in result.completions:
        ids = torch.tensor([result.prompt_token_ids + completion.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids, pixel_values=pixels).logits[0].float()
        law = torch.log_softmax(logits[len(result.prompt_token_ids) - 1 : -1], dim=-1)
        assert len(completion.top_logprobs) == len(completion.token_ids) == 4
        for step, top in zip(law, completion.top_logprobs, strict=True):
            assert top.logprobs == pytest.approx(step.topk(3).values.tolist(), abs=1e-4)
            assert top.logprobs == pytest.approx(step[top.token_ids].tolist(), abs=1e-4)


def test_greedy_stops_and_placeholders(engine) -> None:
    greedy = DecodingParams(temperature=0.0, max_new_tokens=4)
    two = ImagePrompt(text=f"{IMAGE_TOKEN}a{IMAGE_TOKEN}b", images=(RED, STRIPES))
    result = asyncio.run(engine.generate(two, 2, greedy))
    assert result.completions[0].token_ids == result.completions[1].token_ids
    assert all(lp <= 0 and math.isfinite(lp) for lp in result.completions[0].logprobs)
    assert len(result.prompt_token_ids) == 2 * IMAGE_TOKENS + 2
    with pytest.raises(UnsupportedRequest, match=r"prompt is \d+ tokens with its image tokens.*context of 256"):
        asyncio.run(engine.generate(ImagePrompt(text="x" * 200, images=(RED,)), 1, DecodingParams(max_new_tokens=50)))
    with pytest.raises(UnsupportedRequest, match="1 <image> placeholder"):
        asyncio.run(engine.generate(ImagePrompt(text=f"{IMAGE_TOKEN}x", images=(RED, RED)), 1, greedy))


def test_a_text_only_policy_refuses_images(tmp_path) -> None:
    tiny = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 2}
    policy = PolicyConfig(model=tiny)
    model, tokenizer = load_policy(policy)
    assert load_processor(policy) is None
    engine = TorchEngine(model, tokenizer, "cpu", max_batch_rows=2)
    try:
        assert "no image processor" in engine.image_refusal
        with pytest.raises(UnsupportedRequest, match="no image processor"):
            asyncio.run(engine.generate(ImagePrompt(text="x", images=(RED,)), 1, DecodingParams()))
        # The text path is untouched.
        out = asyncio.run(engine.generate("1+1=", 1, DecodingParams(max_new_tokens=3, ignore_eos=True)))
        assert len(out.completions[0].token_ids) == 3
    finally:
        asyncio.run(engine.close())
