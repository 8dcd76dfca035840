"""Image parts at the policy endpoint go through the job's multimodal gate (the scripted backend of test_app)."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from dockyard.agents.contract import SESSION_HEADER
from dockyard.images import ImageLimits
from tests.unit.endpoint.scripted import TOKEN, an, oa


def png_b64(size=(8, 6)) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def openai_image(data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def anthropic_image(data: str) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


async def test_images_are_refused_while_the_gate_is_off(app, backend) -> None:
    content = [{"type": "text", "text": "what is it"}, openai_image(png_b64())]
    with pytest.raises(openai.BadRequestError, match="policy.generation.allow_multimodal_inputs"):
        await oa(app).chat.completions.create(model="job-1", messages=[{"role": "user", "content": content}])
    with pytest.raises(anthropic.BadRequestError, match="policy.generation.allow_multimodal_inputs"):
        await an(app).messages.create(
            model="job-1", max_tokens=4, messages=[{"role": "user", "content": [anthropic_image(png_b64())]}]
        )
    assert backend.prompts == []  # no replica was asked
    # Text alone is unaffected.
    reply = await oa(app).chat.completions.create(model="job-1", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "ok" and backend.images == [None]


async def test_images_pass_the_gate_and_go_to_the_rollout_with_the_rendered_text(app, backend) -> None:
    backend.model_.images = ImageLimits(allowed=True, max_pixels=100, max_images=1)
    content = [{"type": "text", "text": "what is it"}, openai_image(png_b64())]
    reply = await oa(app).chat.completions.create(
        model="job-1", messages=[{"role": "user", "content": content}], extra_headers={SESSION_HEADER: "v1"}
    )
    assert reply.choices[0].message.content == "ok"
    sent = backend.images[-1]
    assert sent.images == [base64.b64decode(png_b64())]
    assert "what is it" in sent.text and sent.text.endswith("assistant: ")  # the chat template's render
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://endpoint")
    trajectory = (await http.get("/v1/sessions/v1/trajectory", headers={"authorization": f"Bearer {TOKEN}"})).json()
    recorded = trajectory["segments"][0]["turns"][0]["prompt_token_ids"]
    assert recorded[:3] == [9, 9, 9]  # the ids the rollout reported (image tokens included) are recorded

    # The job's limits, with the numbers; an image by URL is never fetched.
    with pytest.raises(anthropic.BadRequestError, match="2 images in one prompt; at most 1"):
        await an(app).messages.create(
            model="job-1",
            max_tokens=4,
            messages=[{"role": "user", "content": [anthropic_image(png_b64()), anthropic_image(png_b64())]}],
        )
    with pytest.raises(openai.BadRequestError, match=r"20x10 = 200 pixels; at most 100"):
        await oa(app).chat.completions.create(
            model="job-1", messages=[{"role": "user", "content": [openai_image(png_b64((20, 10)))]}]
        )
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\].image_url.url.*fetches nothing"):
        await oa(app).chat.completions.create(model="job-1", messages=[{"role": "user", "content": [remote]}])
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        await oa(app).chat.completions.create(
            model="job-1", messages=[{"role": "user", "content": [openai_image("@@not-base64@@")]}]
        )
