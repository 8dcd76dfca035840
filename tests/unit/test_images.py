"""The multimodal gate (dockyard/images.py): refusals with numbers, normalisation, the decompression bomb."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from dockyard.config import GenerationConfig
from dockyard.images import GATE_KEY, ImageLimits, ImageRejected, gate_images, normalise_image

OPEN = ImageLimits(allowed=True, max_pixels=10_000, max_images=2)


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **params)
    return out.getvalue()


def test_gate_off_refuses_any_image_naming_the_key() -> None:
    with pytest.raises(ImageRejected, match=GATE_KEY.replace(".", r"\.")):
        gate_images([encode(Image.new("RGB", (4, 4)))], ImageLimits())
    assert gate_images([], ImageLimits()) == []  # the text path never touches the gate


def test_limits_come_from_the_job_config() -> None:
    limits = ImageLimits.from_generation(
        GenerationConfig(allow_multimodal_inputs=True, max_image_pixels=77, max_images_per_sample=3)
    )
    assert limits == ImageLimits(allowed=True, max_pixels=77, max_images=3)
    assert ImageLimits.from_generation(GenerationConfig()).allowed is False


def test_too_many_images_and_too_many_pixels_give_the_numbers() -> None:
    small = encode(Image.new("RGB", (10, 10)))
    with pytest.raises(ImageRejected, match=r"3 images in one prompt; at most 2"):
        gate_images([small] * 3, OPEN)
    big = encode(Image.new("RGB", (200, 60)))
    with pytest.raises(ImageRejected, match=r"images\[1\]: 200x60 = 12000 pixels; at most 10000"):
        gate_images([small, big], OPEN)


def test_unreadable_bytes_are_refused_by_name() -> None:
    with pytest.raises(ImageRejected, match=r"images\[0\]: not a readable image"):
        gate_images([b"not an image at all"], OPEN)


def _png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header (and a tiny IDAT) that declares a width × height canvas."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.mark.parametrize(
    ("side", "says"),
    [
        (9_000, r"9000x9000 = 81000000 pixels; at most 16777216"),  # refused by the gate's header check
        (50_000, r"2500000000 pixels.*at most 16777216"),  # so large that Pillow's own guard fires on open
    ],
)
def test_a_decompression_bomb_is_refused_from_its_header_without_allocating(
    side: int, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bomb = _png_declaring(side, side)  # up to 7.5 GB decoded, in under 200 bytes
    assert len(bomb) < 200

    def no_decoding(self):  # Pillow allocates the canvas in load(): it must never be reached
        raise AssertionError(f"the bomb's {self.size} canvas was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageRejected, match=says):
        normalise_image(bomb, max_pixels=16_777_216)


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 10, 20))  # blue band on the left edge
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    out = normalise_image(encode(image, "JPEG", exif=exif, quality=95), 10_000)
    assert out.size == (20, 40)
    top = out.getpixel((10, 2))
    assert top[2] > 200 and top[0] < 60, top  # the left band is now on top


def test_transparency_is_flattened_onto_white_rgb() -> None:
    image = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    image.putpixel((1, 1), (255, 0, 0, 255))
    out = normalise_image(encode(image), 10_000)
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255)
    assert out.getpixel((1, 1)) == (255, 0, 0)
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, 0, 255, 0])
    palette.putpixel((2, 2), 1)
    out = normalise_image(encode(palette, transparency=0), 10_000)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((2, 2)) == (0, 255, 0)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "TIFF"])
def test_a_multi_frame_image_is_pinned_to_its_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (6, 6), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).n_frames == 3
    out = normalise_image(data, 10_000)
    assert out.mode == "RGB" and out.size == (6, 6)
    assert getattr(out, "n_frames", 1) == 1
    red = out.getpixel((3, 3))
    assert red[0] > 200 and red[1] < 60 and red[2] < 60, red


def test_a_text_only_policy_or_another_engine_with_the_gate_on_is_caught_before_launch(tmp_path) -> None:
    from pathlib import Path

    from dockyard.config import ConfigError, load_config
    from dockyard.preflight import ERROR, SKIP, check_image_processor

    tiny = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_expr.yaml"
    random_init = ["policy.model_name=null", "policy.bootstrap=null"]
    assert check_image_processor(load_config(tiny, random_init), prepare=False).status == SKIP  # gate off
    on = [*random_init, "policy.generation.allow_multimodal_inputs=true"]
    finding = check_image_processor(load_config(tiny, on), prepare=False)
    assert finding.status == ERROR and "text-only" in finding.message
    (tmp_path / "config.json").write_text("{}")  # a model folder without an image processor
    folder = load_config(tiny, [f"policy.model_name={tmp_path}", "policy.generation.allow_multimodal_inputs=true"])
    finding = check_image_processor(folder, prepare=False)
    assert finding.status == ERROR and "no image processor (processor_config.json)" in finding.message
    with pytest.raises(ConfigError, match="torch engine only; backend sglang refuses them"):
        load_config(tiny, [*on, "policy.generation.backend=sglang"])
