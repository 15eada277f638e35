"""Images in chat requests, up to the pixels a vision encoder takes: decoding with limits, the
model's resize and normalization (as HF's image processor does them), and the expansion of each
image placeholder into the image tokens the language model reads.

Light: PIL and numpy, no torch (docs/architecture.md invariant 7), since the tokenizer stage runs
it. Every refusal is an `ImageError` whose message names the problem, for a 400.

One family's rules so far, Gemma 3's: a fixed image size (pan-and-scan off, HF's default),
bilinear resize, rescale and normalize, and each `<start_of_image>` in the rendered chat replaced
by "\\n\\n<start_of_image>" + `mm_tokens_per_image` x "<image_soft_token>" + "<end_of_image>\\n\\n".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from services.common.vision_language import is_vision_language

# What a request may send. GIF gives its first frame, as HF's loader does.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_DATA_URL = re.compile(
    r"data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,"
)


class ImageError(ValueError):
    """An image a request cannot use; the message names what is wrong with it."""


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:image/...` URL, at most `max_bytes` of them (http(s) URLs are
    the tokenizer's to fetch: services/tokenizer/image_fetch.py)."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("image_url: must be a data: URL (data:image/png;base64,...) or an http(s) URL")
    media = match["media"] or "text/plain"
    if not media.startswith("image/"):
        raise ImageError(f"image_url: the data URL's media type is {media}, not an image")
    if not match["b64"]:
        raise ImageError("image_url: the data URL must be base64 (data:image/...;base64,...)")
    payload = url[match.end() :]
    # Refused before decoding, so a huge URL costs no decode: 4 base64 characters are 3 bytes.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ImageError(f"image_url: the image is over the {max_bytes}-byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image_url: the data URL is not valid base64 ({exc})") from None
    if len(data) > max_bytes:
        raise ImageError(f"image_url: the image is {len(data)} bytes, over the {max_bytes}-byte limit")
    return data


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The image in `data`, decoded whole and converted to RGB with any transparency over white
    (HF's convert_to_rgb). Its size is checked from the header, before the pixels are decoded, so
    a small file that would decode to a huge image costs nothing."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"image: not an image of a supported type ({', '.join(FORMATS.values())})") from None
    except Image.DecompressionBombError as exc:  # PIL's own guard, far above any sane limit
        raise ImageError(f"image: over the {max_pixels}-pixel limit ({exc})") from None
    if image.format not in FORMATS:
        raise ImageError(f"image: type {image.format} is not supported ({', '.join(FORMATS.values())})")
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"image: {width}x{height} is over the {max_pixels}-pixel limit")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # what PIL raises for truncated or corrupt data
        raise ImageError(f"image: the {FORMATS[image.format]} data is truncated or corrupt ({exc})") from None
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


@dataclass(frozen=True)
class ImageRules:
    """How one model takes images: the pixels its encoder reads, and its image tokens."""

    height: int
    width: int
    resample: int  # a PIL resampling filter
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    tokens_per_image: int
    placeholder: str  # what the chat template renders for each image
    image_token: str
    image_token_id: int
    end_token: str

    @classmethod
    def from_dir(cls, model_dir: Path) -> ImageRules:
        """Read from config.json, the processor's config (processor_config.json as transformers
        5 saves it, or the older preprocessor_config.json) and the tokenizer's added tokens."""
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        if "Gemma3ForConditionalGeneration" not in config.get("architectures", []):
            raise ValueError(
                f"no image rules for architectures {config.get('architectures')}: only Gemma 3's"
            )
        if (model_dir / "preprocessor_config.json").exists():
            processor = json.loads((model_dir / "preprocessor_config.json").read_text())
        else:
            processor = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]
        if processor.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan is not supported: set do_pan_and_scan false")
        added = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", [])
        token_text = {token["id"]: token["content"] for token in added}
        ids = [config["boi_token_index"], config["image_token_index"], config["eoi_token_index"]]
        if any(i not in token_text for i in ids):
            raise ValueError(f"the tokenizer lacks the image tokens {ids} among its added tokens")
        size = processor.get("size", {"height": 224, "width": 224})
        return cls(
            height=size["height"],
            width=size["width"],
            resample=processor.get("resample", Image.Resampling.BILINEAR),
            rescale_factor=processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1.0,
            mean=tuple(processor.get("image_mean", (0.5, 0.5, 0.5))) if processor.get("do_normalize", True) else (0.0,) * 3,
            std=tuple(processor.get("image_std", (0.5, 0.5, 0.5))) if processor.get("do_normalize", True) else (1.0,) * 3,
            tokens_per_image=config.get("mm_tokens_per_image", 256),
            placeholder=token_text[ids[0]],
            image_token=token_text[ids[1]],
            image_token_id=ids[1],
            end_token=token_text[ids[2]],
        )  # fmt: skip

    def pixels(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32: resized, rescaled and normalized as HF's PIL backend does."""
        resized = np.asarray(
            image.resize((self.width, self.height), resample=self.resample), dtype=np.float32
        )
        scaled = resized.transpose(2, 0, 1) * np.float32(self.rescale_factor)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return ((scaled - mean) / std).astype(np.float32)

    def expand(self, text: str, num_images: int) -> str:
        """`text` with each image placeholder replaced by the image's tokens; the placeholders
        must be exactly `num_images`."""
        found = text.count(self.placeholder)
        if found != num_images:
            raise ImageError(f"the chat template rendered {found} image placeholders for {num_images} images")
        image = f"\n\n{self.placeholder}{self.image_token * self.tokens_per_image}{self.end_token}\n\n"
        return text.replace(self.placeholder, image)


def image_rules_of(model_dir: Path) -> ImageRules | None:
    """The rules of a vision-language checkpoint's images; None for a model that reads none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return ImageRules.from_dir(model_dir) if is_vision_language(config) else None


def pixels_key(pixels: np.ndarray) -> bytes:
    """The content hash of an image's pixels as the encoder reads them: the key of its cached
    embeddings (the same picture sent as PNG or as WebP is one entry)."""
    return hashlib.blake2b(np.ascontiguousarray(pixels).tobytes(), digest_size=16).digest()
