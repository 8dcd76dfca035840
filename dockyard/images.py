"""The multimodal gate: image bytes in, normalised RGB images out, or a clear refusal.

    image bytes ──gate (policy.generation.allow_multimodal_inputs)──> count ≤ max_images_per_sample
        ──Image.open (header only)──> width × height ≤ max_image_pixels ──first frame──> load
        ──EXIF orientation──> alpha onto white ──> RGB image ──> engine

Guarantees: `gate_images` is the one check every entry point (the rollout servicer, the policy
endpoint) runs before an engine sees an image. With the gate off, any image is refused with a
message naming `policy.generation.allow_multimodal_inputs`; over the limits, the message gives the
numbers (which image, its size, the limit). The pixel limit is checked on the size the file's
header declares, before a single pixel is decoded, so a small file declaring a huge canvas (a
decompression bomb) is refused without allocating it (Pillow's own guard, at its default, stays
on behind it). Only the formats in FORMATS are opened. Every image that passes
is a fresh RGB image with its EXIF orientation applied, transparency flattened onto white, and,
for a multi-frame file (GIF, APNG, TIFF, WebP), its first frame only. Nothing here knows a model.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageOps

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "TIFF", "BMP")
GATE_KEY = "policy.generation.allow_multimodal_inputs"
WHITE = (255, 255, 255)


class ImageRejected(ValueError):
    """An image input that cannot pass the gate; the message names the input and the fix."""


@dataclass(frozen=True)
class ImageLimits:
    """The gate's settings, as policy.generation holds them."""

    allowed: bool = False
    max_pixels: int = 16_777_216
    max_images: int = 8

    @classmethod
    def from_generation(cls, generation) -> ImageLimits:
        """The limits of a job's `policy.generation` section (dockyard.config.GenerationConfig)."""
        return cls(
            allowed=generation.allow_multimodal_inputs,
            max_pixels=generation.max_image_pixels,
            max_images=generation.max_images_per_sample,
        )


def gate_images(images: Sequence[bytes], limits: ImageLimits, field: str = "images") -> list[Image.Image]:
    """The images normalised (see the module docstring), or ImageRejected naming what is wrong."""
    if not images:
        return []
    if not limits.allowed:
        raise ImageRejected(
            f"{field}: {len(images)} image(s) given but this job takes text only; set {GATE_KEY}=true "
            "(with a vision-language policy) to accept images"
        )
    if len(images) > limits.max_images:
        raise ImageRejected(
            f"{field}: {len(images)} images in one prompt; at most {limits.max_images} "
            "(policy.generation.max_images_per_sample)"
        )
    return [normalise_image(data, limits.max_pixels, f"{field}[{i}]") for i, data in enumerate(images)]


def normalise_image(data: bytes, max_pixels: int, name: str = "image") -> Image.Image:
    """One image's bytes as an RGB image: size checked from the header first, then decoded and normalised."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as exc:  # Pillow's own guard may already fire on open
        raise ImageRejected(
            f"{name}: {exc}; at most {max_pixels} pixels (policy.generation.max_image_pixels)"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageRejected(f"{name}: not a readable image ({', '.join(FORMATS)}): {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageRejected(
            f"{name}: {width}x{height} = {width * height} pixels; at most {max_pixels} "
            "(policy.generation.max_image_pixels)"
        )
    try:
        return _decode_first_frame(image)
    except Image.DecompressionBombError as exc:
        raise ImageRejected(f"{name}: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageRejected(f"{name}: the image data is damaged: {exc}") from None


def _decode_first_frame(image: Image.Image) -> Image.Image:
    image.seek(0)  # multi-frame files: the first frame only
    image.load()
    if getattr(image, "n_frames", 1) > 1:
        image = image.copy()  # one frame, detached from the file's other frames
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, WHITE)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")
