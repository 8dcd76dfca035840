"""A small random-init vision-language policy, written to a folder like a real checkpoint.

    char tokenizer + <image> ──┐
    CLIP vision tower (tiny) ──┼── LLaVA (projector + Llama LM) ──save_pretrained──> folder
    CLIP image processor (PIL) ┘   processor (inserts IMAGE_TOKENS <image> per image) ──┘

Guarantees: built offline from configs alone, with weights drawn from a generator seeded by `seed`
(same seed, same weights); the folder loads back with AutoModelForImageTextToText / AutoProcessor
(dockyard.models.load) exactly as a downloaded checkpoint would. The image processor is the
Pillow-only one, so no torchvision is needed. Each image becomes IMAGE_TOKENS tokens of the prompt.
For tests and the tiny multimodal recipe, not for learning anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from dockyard.models.tokenizer import build_char_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # patches; the CLS feature is dropped ("default" strategy)


def build_tiny_vlm(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny LLaVA-shaped model, its tokenizer and its processor to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
