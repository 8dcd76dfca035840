"""Images through a real rollout server: the gate at the boundary, then a vision-language policy generating."""

from __future__ import annotations

import asyncio
import io
import struct
import zlib

import grpc
import pytest
from PIL import Image

from dockyard.api.common.v1 import common_pb2
from dockyard.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from dockyard.models.vision import IMAGE_TOKEN, IMAGE_TOKENS, build_tiny_vlm
from dockyard.rpc.client import connect, health_status
from services.endpoint.backend import Backend, GenerateRefused, Prompted
from services.endpoint.routing import Replica
from tests.conftest import expect_code

TEXT_POLICY = """
policy:
  model: {model_type: llama, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
          num_key_value_heads: 2, intermediate_size: 64, max_position_embeddings: 256}
  train_global_batch_size: 4
  train_micro_batch_size: 2
  generation: {max_new_tokens: 4%s}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""
VLM_POLICY = """
policy:
  model_name: %s
  train_global_batch_size: 4
  train_micro_batch_size: 2
  generation: {max_new_tokens: 4, allow_multimodal_inputs: true, max_images_per_sample: 2, max_image_pixels: 4096}
grpo: {num_prompts_per_step: 2, num_generations_per_prompt: 2}
"""
ENV = {"DOCKYARD_ROLLOUT_NUM_THREADS": "1"}


def png(size=(40, 30), color=(200, 20, 20)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def bomb(side: int = 9_000) -> bytes:
    """A PNG of ~100 bytes whose header declares a side × side canvas."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_images_pass_the_gate_at_the_rollout_boundary(start_service, tmp_path) -> None:
    folder = build_tiny_vlm(tmp_path / "tiny-vlm", seed=1)
    rollout = start_service("rollout", ENV)
    asyncio.run(_images(rollout.address, str(folder)))
    assert rollout.stop() == 0, rollout.logs()[-3000:]


async def _images(address: str, folder: str) -> None:
    async with connect(address, default_timeout=120) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, seed=5)

        def generate(job: str, **fields) -> rollout_pb2.GenerateRequest:
            return rollout_pb2.GenerateRequest(job_id=job, num_samples=2, sampling=sampling, **fields)

        # Gate off (the default): images are refused naming the key; the text path is unaffected.
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="job-text", config_yaml=TEXT_POLICY % ""))
        await expect_code(
            stub.Generate(generate("job-text", prompt="1+2=", images=[png()])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "policy.generation.allow_multimodal_inputs",
        )
        assert len((await stub.Generate(generate("job-text", prompt="1+2="))).completions) == 2

        # Gate on, but a text-only policy: the engine cannot take them (a state, not the request's fault).
        on = TEXT_POLICY % ", allow_multimodal_inputs: true"
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="job-text-on", config_yaml=on))
        await expect_code(
            stub.Generate(generate("job-text-on", prompt="1+2=", images=[png()])),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no image processor",
        )

        # A vision-language policy loaded from its folder generates from an image.
        await stub.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="job-vlm", config_yaml=VLM_POLICY % folder))
        reply = await stub.Generate(generate("job-vlm", prompt="f(x)=", images=[png()]))
        assert len(reply.prompt_token_ids) == IMAGE_TOKENS + len("f(x)=")
        assert len(set(reply.prompt_token_ids[:IMAGE_TOKENS])) == 1  # the processor's image token
        assert all(1 <= len(c.token_ids) == len(c.logprobs) <= 4 for c in reply.completions)
        assert await stub.Generate(generate("job-vlm", prompt="f(x)=", images=[png()])) == reply  # seeded
        messages = [rollout_pb2.ChatMessage(role="user", content=f"{IMAGE_TOKEN}what")]
        chat = await stub.Generate(generate("job-vlm", messages=messages, images=[png(color=(0, 0, 255))]))
        assert len(chat.prompt_token_ids) > IMAGE_TOKENS

        # Over the limits: INVALID_ARGUMENT with the numbers; a decompression bomb is refused from its header.
        for fields, words in [
            (dict(images=[png()] * 3), ("3 images", "at most 2")),
            (dict(images=[png(size=(100, 50))]), ("images[0]", "100x50 = 5000 pixels", "at most 4096")),
            (dict(images=[png(), bomb()]), ("images[1]", "9000x9000 = 81000000 pixels")),
            (dict(images=[b"GIF89a broken"]), ("images[0]", "not a readable image")),
        ]:
            await expect_code(
                stub.Generate(generate("job-vlm", prompt="x", **fields)), grpc.StatusCode.INVALID_ARGUMENT, *words
            )
        await expect_code(
            stub.Generate(generate("job-vlm", prompt_token_ids=[5, 6], images=[png()])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not prompt_token_ids",
        )
        assert await health_status(address) == "SERVING"
        assert len((await stub.Generate(generate("job-vlm", prompt="x", images=[png()]))).completions) == 2

    # The policy endpoint's call of a replica: text and image bytes go, the ids come back.
    backend = Backend("127.0.0.1:1", generate_timeout=60)
    try:
        replica = Replica("rollout", address)
        got = await backend.generate("job-vlm", replica, [], 2, sampling, Prompted("f(x)=", [png()]))
        assert len(got.prompt_token_ids) == IMAGE_TOKENS + len("f(x)=") and len(got.completions) == 2
        with pytest.raises(GenerateRefused, match="no image processor"):  # the caller's fault, not a lost replica
            await backend.generate("job-text-on", replica, [], 1, sampling, Prompted("x", [png()]))
    finally:
        await backend.close()
