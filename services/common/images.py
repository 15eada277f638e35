"""Images in chat requests, up to the pixels a vision encoder takes: decoding with limits, the
model's resize and normalization (as HF's image processor does them), and the expansion of each
image placeholder into the image tokens the language model reads.

Light: PIL and numpy, no torch (docs/architecture.md invariant 7), since the tokenizer stage runs
it. Every refusal is an `ImageError` whose message names the problem, for a 400.

An image is one or more tiles, each an encoder input of its own whose embeddings fill one run of
`tokens_per_tile` image tokens. Two families' rules:
- Gemma 3 (`Gemma3ImageRules`): one tile, a fixed image size (pan-and-scan off, HF's default),
  bilinear resize, rescale and normalize; each `<start_of_image>` in the rendered chat replaced by
  "\\n\\n<start_of_image>" + `mm_tokens_per_image` x "<image_soft_token>" + "<end_of_image>\\n\\n".
- SmolVLM / Idefics3 (`Idefics3ImageRules`): with `do_image_splitting`, a grid of square tiles of
  the image resized up to multiples of the tile size, then the whole image as a "global" tile;
  without, the global tile alone. Each `<image>` is replaced by a `<fake_token_around_image>` +
  `<row_r_col_c>` + `image_seq_len` x `<image>` run per grid tile, then the global tile's run;
  so the tokens, unlike Gemma's, depend on the image's size.
- Qwen2.5-VL (`Qwen2VLImageRules`): one tile, the image resized to multiples of patch_size x
  merge_size within the processor's pixel bounds (HF's smart_resize), bicubic; the tower cuts it
  into patches itself. The template's `<|image_pad|>` becomes one per merged patch, so the number
  of tokens is the image's own (the tile's grid, which the language model's M-RoPE also reads).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from services.common.vision_language import is_vision_language

# HF's default normalization for Qwen2-VL (OpenAI CLIP's), where the processor's config gives none.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# What a request may send. GIF gives its first frame, as HF's loader does.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# EXIF's Orientation tag, and the transposition that shows an image of each value upright (PIL's
# ImageOps.exif_transpose table): a phone's portrait photo is stored sideways, tagged 6.
EXIF_ORIENTATION = 0x0112
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_DATA_URL = re.compile(
    r"data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,"
)


class ImageError(ValueError):
    """An image a request cannot use; the message names what is wrong with it."""


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:image/...` URL, at most `max_bytes` of them (http(s) URLs are
    the tokenizer's to fetch: services/common/image_fetch.py)."""
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
    """The image in `data`, decoded whole, turned upright as its EXIF orientation says (as HF's
    load_image and any image viewer show it), and converted to RGB with any transparency over
    white (HF's convert_to_rgb). Its size is checked from the header, before the pixels are
    decoded, so a small file that would decode to a huge image costs nothing."""
    image = _open_header(data, max_pixels)
    upright = UPRIGHT.get(_orientation(image))
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # what PIL raises for truncated or corrupt data
        raise ImageError(f"image: the {FORMATS[image.format]} data is truncated or corrupt ({exc})") from None
    if upright is not None:
        image = image.transpose(upright)
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an image file, from its header alone (the tokenizer's count of its
    tokens; the encoder decodes it whole, with every check of `open_image`), refused as the encoder
    would refuse it where that header says more than `max_pixels` pixels or a type it does not
    read."""
    with _open_header(data, max_pixels) as image:
        width, height = image.size
        # Turned a quarter (EXIF 5 to 8), the upright image that open_image gives is its height wide.
        return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation (1 to 8) of an image opened from its header, 1 where it has none or an
    unreadable one. Read from the header alone (a JPEG's APP1, a WebP's EXIF chunk, a PNG's eXIf
    before its pixel data), so that the tokenizer, which counts an image's tokens from its size
    before it is decoded, and the encoder, which decodes it, turn it alike."""
    raw = image.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        orientation = exif.get(EXIF_ORIENTATION, 1)
    except Exception:  # malformed EXIF: PIL raises whatever its parser hits; the pixels are still good
        return 1
    return orientation if orientation in range(1, 9) else 1


def _open_header(data: bytes, max_pixels: int) -> Image.Image:
    """The image in `data`, opened from its header (no pixel decoded yet), its size within
    `max_pixels` (encoder.max_image_pixels), of a type a request may send."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        # PIL's own guard, far above any sane limit, refuses the header before it tells the size;
        # it is an image over the limit all the same, not one of an unknown type.
        raise ImageError(f"image: over the {max_pixels}-pixel limit ({exc})") from None
    except OSError:  # UnidentifiedImageError, or a header PIL cannot parse
        raise ImageError(f"image: not an image of a supported type ({', '.join(FORMATS.values())})") from None
    except ValueError as exc:
        # A header chunk PIL refuses while opening: a PNG's zTXt / iTXt / iCCP that decompresses
        # past its MAX_TEXT_CHUNK (a small file's bomb), text chunks past MAX_TEXT_MEMORY, a
        # truncated pHYs. The request's fault, a 400, not an internal error of the stage.
        raise ImageError(f"image: its header is corrupt or over PIL's limits ({exc})") from None
    if image.format not in FORMATS:
        image.close()
        raise ImageError(f"image: type {image.format} is not supported ({', '.join(FORMATS.values())})")
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageError(f"image: {width}x{height} is over the {max_pixels}-pixel limit")
    return image


def _processor_config(model_dir: Path) -> dict:
    """The image processor's config: preprocessor_config.json, or processor_config.json's
    `image_processor` as transformers 5 saves it."""
    if (model_dir / "preprocessor_config.json").exists():
        return json.loads((model_dir / "preprocessor_config.json").read_text())
    return json.loads((model_dir / "processor_config.json").read_text())["image_processor"]


def _added_tokens(model_dir: Path) -> dict[str, int]:
    added = json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    return {token["content"]: token["id"] for token in added}


@dataclass(frozen=True)
class Normalization:
    """HF's rescale and normalize, as its PIL backend does them, from a processor config."""

    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_processor(cls, processor: dict) -> Normalization:
        do_normalize = processor.get("do_normalize", True)
        return cls(
            rescale_factor=processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1.0,
            mean=tuple(processor.get("image_mean", (0.5, 0.5, 0.5))) if do_normalize else (0.0,) * 3,
            std=tuple(processor.get("image_std", (0.5, 0.5, 0.5))) if do_normalize else (1.0,) * 3,
        )  # fmt: skip

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32 of an RGB image already at its size."""
        # In float32 (HF rescales in float64, then rounds: at most 1 ulp from HF's values).
        scaled = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(self.rescale_factor)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return ((scaled - mean) / std).astype(np.float32)


class ImageRules:
    """How one model takes images: the tiles its encoder reads, and its image tokens. Each
    placeholder the chat template renders (`placeholder`) becomes an image's tokens."""

    placeholder: str
    image_token: str
    image_token_id: int
    # Each tile's image tokens, for the families whose tiles are all one size (see `tile_tokens`).
    tokens_per_tile: int
    # Whether an image's tokens depend on its size (which the tokenizer reads from its header,
    # an http(s) image's once it is fetched).
    needs_sizes: bool

    @staticmethod
    def from_dir(model_dir: Path) -> ImageRules:
        """Read from config.json, the processor's config and the tokenizer's added tokens."""
        model_dir = Path(model_dir)
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures", [])
        if "Gemma3ForConditionalGeneration" in architectures:
            return Gemma3ImageRules.from_dir(model_dir)
        if {"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"} & set(architectures):
            return Idefics3ImageRules.from_dir(model_dir)
        if "Qwen2_5_VLForConditionalGeneration" in architectures:
            return Qwen2VLImageRules.from_dir(model_dir)
        raise ValueError(
            f"no image rules for architectures {architectures}: Gemma 3's, SmolVLM's, Idefics3's, Qwen2.5-VL's"
        )

    def tiles(self, image: Image.Image) -> list[np.ndarray]:
        """The encoder's inputs for an image, in the order its token runs take them: each
        [3, tile height, tile width] float32, resized and normalized as HF's processor does."""
        raise NotImplementedError

    def image_text(self, size: tuple[int, int] | None) -> str:
        """The text an image of `size` (width, height; None where unknown) takes in the prompt."""
        raise NotImplementedError

    @property
    def fewest_tile_tokens(self) -> int:
        """The fewest image tokens a tile can take: the encoder cache's page (one page per
        tile for the families whose tiles are all one size)."""
        return self.tokens_per_tile

    @property
    def most_image_tokens(self) -> int:
        """The most image tokens one image can take, all its tiles': what an encoder's cache must
        hold at least (a Gemma 3 image is one tile; Qwen2.5-VL's `tokens_per_tile` is its most)."""
        return self.tokens_per_tile

    def pixels_tokens(self, pixels: np.ndarray) -> int:
        """The image tokens of a tile of `pixels` (one of `tiles`), as the encoder makes them."""
        return self.tokens_per_tile

    def tile_tokens(self, size: tuple[int, int] | None) -> list[int]:
        """The number of image tokens of each tile of an image of `size`, in prompt order."""
        num_tiles = self.image_text(size).count(self.image_token) // self.tokens_per_tile
        return [self.tokens_per_tile] * num_tiles

    def tile_grid_width(self, size: tuple[int, int] | None) -> int:
        """The width in image tokens of each tile's grid, for the language models whose rotary
        positions follow it (M-RoPE); 0 for the others."""
        return 0

    def expand(self, text: str, sizes: list[tuple[int, int] | None]) -> str:
        """`text` with each image placeholder replaced by its image's tokens; the placeholders
        must be exactly one per image of `sizes`."""
        pieces = text.split(self.placeholder)
        if len(pieces) - 1 != len(sizes):
            raise ImageError(
                f"the chat template rendered {len(pieces) - 1} image placeholders for {len(sizes)} images"
            )
        out = [pieces[0]]
        for size, piece in zip(sizes, pieces[1:], strict=True):
            out += [self.image_text(size), piece]
        return "".join(out)


@dataclass(frozen=True)
class Gemma3ImageRules(ImageRules):
    height: int
    width: int
    resample: int  # a PIL resampling filter
    normalize: Normalization
    tokens_per_tile: int
    placeholder: str
    image_token: str
    image_token_id: int
    end_token: str
    needs_sizes: bool = False

    @classmethod
    def from_dir(cls, model_dir: Path) -> Gemma3ImageRules:
        config = json.loads((model_dir / "config.json").read_text())
        processor = _processor_config(model_dir)
        if processor.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan-and-scan is not supported: set do_pan_and_scan false")
        token_text = {i: text for text, i in _added_tokens(model_dir).items()}
        ids = [config["boi_token_index"], config["image_token_index"], config["eoi_token_index"]]
        if any(i not in token_text for i in ids):
            raise ValueError(f"the tokenizer lacks the image tokens {ids} among its added tokens")
        size = processor.get("size", {"height": 224, "width": 224})
        return cls(
            height=size["height"],
            width=size["width"],
            resample=processor.get("resample", Image.Resampling.BILINEAR),
            normalize=Normalization.from_processor(processor),
            tokens_per_tile=config.get("mm_tokens_per_image", 256),
            placeholder=token_text[ids[0]],
            image_token=token_text[ids[1]],
            image_token_id=ids[1],
            end_token=token_text[ids[2]],
        )

    def pixels(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32: resized, rescaled and normalized as HF's PIL backend does."""
        return self.normalize(image.resize((self.width, self.height), resample=self.resample))

    def tiles(self, image: Image.Image) -> list[np.ndarray]:
        return [self.pixels(image)]

    def image_text(self, size: tuple[int, int] | None) -> str:
        return f"\n\n{self.placeholder}{self.image_token * self.tokens_per_tile}{self.end_token}\n\n"


# HF's SmolVLM / Idefics3 processors never resize past this (4k).
MAX_IDEFICS3_SIDE = 4096


@dataclass(frozen=True)
class Idefics3ImageRules(ImageRules):
    longest_edge: int  # the processor's `size`: the image's longest side is resized to it
    tile: int  # `max_image_size`: the side of every tile, the vision tower's image size
    split: bool  # `do_image_splitting`
    resample: int
    normalize: Normalization
    tokens_per_tile: int  # the processor's `image_seq_len`
    image_token_id: int
    placeholder: str = "<image>"
    image_token: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"

    @property
    def needs_sizes(self) -> bool:  # type: ignore[override]
        return self.split

    @classmethod
    def from_dir(cls, model_dir: Path) -> Idefics3ImageRules:
        config = json.loads((model_dir / "config.json").read_text())
        processor = _processor_config(model_dir)
        vision = config["vision_config"]
        scale = config.get("scale_factor", 2)
        tokens = (vision["image_size"] // vision["patch_size"]) ** 2 // scale**2
        tile = processor.get("max_image_size", {"longest_edge": 364})["longest_edge"]
        if tile != vision["image_size"]:
            raise ValueError(
                f"the processor's max_image_size {tile} is not the vision tower's image_size {vision['image_size']}"
            )
        added = _added_tokens(model_dir)
        rules = cls(
            longest_edge=processor.get("size", {"longest_edge": 4 * tile})["longest_edge"],
            tile=tile,
            split=processor.get("do_image_splitting", True),
            resample=processor.get("resample", Image.Resampling.LANCZOS),
            normalize=Normalization.from_processor(processor),
            tokens_per_tile=tokens,
            image_token_id=config.get("image_token_id", added.get("<image>", -1)),
        )
        needed = [rules.image_token, rules.fake_token, rules.global_token]
        if rules.split:
            rows, cols = rules.grid(MAX_IDEFICS3_SIDE, MAX_IDEFICS3_SIDE)
            needed.append(f"<row_{rows}_col_{cols}>")
        missing = [token for token in needed if token not in added]
        if missing or added[rules.image_token] != rules.image_token_id:
            raise ValueError(
                f"the tokenizer lacks the image tokens {missing or needed[:1]} among its added tokens"
            )
        return rules

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's first resize: the longest side to
        `longest_edge` (up or down; the other side even), within MAX_IDEFICS3_SIDE."""
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > MAX_IDEFICS3_SIDE:
            width, height = MAX_IDEFICS3_SIDE, int(MAX_IDEFICS3_SIDE / aspect)
        elif height > width and height > MAX_IDEFICS3_SIDE:
            height, width = MAX_IDEFICS3_SIDE, int(MAX_IDEFICS3_SIDE * aspect)
        return max(width, 1), max(height, 1)

    def _split_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the resized image takes before splitting: each side up to a
        multiple of the tile (the shorter through the aspect ratio, as HF computes it)."""
        aspect = width / height
        if width >= height:
            width = math.ceil(width / self.tile) * self.tile
            height = math.ceil(int(width / aspect) / self.tile) * self.tile
        else:
            height = math.ceil(height / self.tile) * self.tile
            width = math.ceil(int(height * aspect) / self.tile) * self.tile
        return width, height

    @property
    def most_image_tokens(self) -> int:  # type: ignore[override]
        # A square image splits into the most tiles: its longest side's, both ways (n x n), each
        # side resized to `longest_edge` within MAX_IDEFICS3_SIDE; then the global tile.
        rows, cols = self.grid(MAX_IDEFICS3_SIDE, MAX_IDEFICS3_SIDE)
        return (rows * cols + 1) * self.tokens_per_tile

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of the tiles an image of this size splits into; (0, 0): the global
        tile alone."""
        if not self.split:
            return 0, 0
        width, height = self._split_size(*self._resized(width, height))
        if width <= self.tile and height <= self.tile:
            return 0, 0
        return height // self.tile, width // self.tile

    def tiles(self, image: Image.Image) -> list[np.ndarray]:
        resized = image.resize(self._resized(*image.size), resample=self.resample)
        rows, cols = self.grid(*image.size)
        if not self.split or not rows:
            # Not split (or too small to): the whole image at the tile size, from the resized one.
            if self.split:
                resized = resized.resize(self._split_size(*resized.size), resample=self.resample)
            return [self.normalize(resized.resize((self.tile, self.tile), resample=self.resample))]
        resized = resized.resize((cols * self.tile, rows * self.tile), resample=self.resample)
        t = self.tile
        crops = [
            resized.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)
        ]
        return [self.normalize(crop) for crop in crops] + [
            self.normalize(resized.resize((t, t), resample=self.resample))
        ]

    def image_text(self, size: tuple[int, int] | None) -> str:
        assert size is not None or not self.split, "a split image's tokens need its size (needs_sizes)"
        rows, cols = self.grid(*size) if size is not None else (0, 0)
        run = self.image_token * self.tokens_per_tile
        global_tile = f"{self.fake_token}{self.global_token}{run}{self.fake_token}"
        if not rows:
            return global_tile
        grid = "".join(
            "".join(f"{self.fake_token}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{global_tile}"


# HF's Qwen2-VL processor refuses images more elongated than this.
MAX_QWEN2VL_ASPECT = 200


@dataclass(frozen=True)
class Qwen2VLImageRules(ImageRules):
    patch_size: int
    merge_size: int  # merge_size x merge_size patches make one image token
    min_pixels: int
    max_pixels: int
    resample: int
    normalize: Normalization
    image_token_id: int
    placeholder: str = "<|image_pad|>"
    image_token: str = "<|image_pad|>"
    needs_sizes: bool = True

    @property
    def tokens_per_tile(self) -> int:  # type: ignore[override]
        """The most image tokens an image can take."""
        return self.max_pixels // self.factor**2

    @property
    def fewest_tile_tokens(self) -> int:  # type: ignore[override]
        # smart_resize scales an image under min_pixels up to at least that many pixels.
        return max(1, min(self.tokens_per_tile, self.min_pixels // self.factor**2))

    def pixels_tokens(self, pixels: np.ndarray) -> int:
        return (pixels.shape[-2] // self.factor) * (pixels.shape[-1] // self.factor)

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this: one image token's pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, model_dir: Path) -> Qwen2VLImageRules:
        config = json.loads((model_dir / "config.json").read_text())
        processor = _processor_config(model_dir)
        vision = config["vision_config"]
        size = processor.get("size") or {}
        rules = cls(
            patch_size=processor.get("patch_size", 14),
            merge_size=processor.get("merge_size", 2),
            # An older config's min_pixels / max_pixels win over its size, as HF's __init__ has it.
            min_pixels=processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
            max_pixels=processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
            resample=processor.get("resample", Image.Resampling.BICUBIC),
            normalize=Normalization.from_processor(
                {"image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD, **processor}
            ),
            image_token_id=config.get("image_token_id", -1),
        )
        tower = (
            vision.get("patch_size", 14),
            vision.get("spatial_merge_size", 2),
            vision.get("temporal_patch_size", 2),
        )
        ours = (rules.patch_size, rules.merge_size, processor.get("temporal_patch_size", 2))
        if ours != tower:
            raise ValueError(
                f"the processor's patch_size, merge_size, temporal_patch_size {ours} are not the vision "
                f"tower's patch_size, spatial_merge_size, temporal_patch_size {tower}"
            )
        if rules.tokens_per_tile < 1 or rules.min_pixels > rules.max_pixels:
            raise ValueError(
                f"the processor's pixel bounds [{rules.min_pixels}, {rules.max_pixels}] hold no "
                f"{rules.factor}x{rules.factor} image token"
            )
        if _added_tokens(model_dir).get(rules.image_token) != rules.image_token_id:
            raise ValueError(
                f"the tokenizer lacks the image token {rules.image_token!r} (id {rules.image_token_id}) "
                "among its added tokens"
            )
        return rules

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is resized to, as HF's smart_resize: each side rounded to a
        multiple of `factor`, then both scaled (aspect kept) into [min_pixels, max_pixels]."""
        if max(width, height) / min(width, height) > MAX_QWEN2VL_ASPECT:
            raise ImageError(
                f"image: {width}x{height} is more than {MAX_QWEN2VL_ASPECT} times as long as it is wide"
            )
        f = self.factor
        new_height, new_width = round(height / f) * f, round(width / f) * f
        if new_height * new_width > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            new_height = max(f, math.floor(height / beta / f) * f)
            new_width = max(f, math.floor(width / beta / f) * f)
        elif new_height * new_width < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            new_height, new_width = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return new_width, new_height

    def tiles(self, image: Image.Image) -> list[np.ndarray]:
        return [self.normalize(image.resize(self.resized(*image.size), resample=self.resample))]

    def _grid(self, size: tuple[int, int] | None) -> tuple[int, int]:
        """(rows, columns) of the image tokens of an image of `size`."""
        assert size is not None, "Qwen2.5-VL's image tokens need the image's size (needs_sizes)"
        width, height = self.resized(*size)
        return height // self.factor, width // self.factor

    def image_text(self, size: tuple[int, int] | None) -> str:
        rows, columns = self._grid(size)
        return self.image_token * (rows * columns)

    def tile_tokens(self, size: tuple[int, int] | None) -> list[int]:
        rows, columns = self._grid(size)
        return [rows * columns]

    def tile_grid_width(self, size: tuple[int, int] | None) -> int:
        return self._grid(size)[1]


def image_rules_of(model_dir: Path) -> ImageRules | None:
    """The rules of a vision-language checkpoint's images; None for a model that reads none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return ImageRules.from_dir(model_dir) if is_vision_language(config) else None


def pixels_key(pixels: np.ndarray) -> bytes:
    """The content hash of an image's pixels as the encoder reads them: the key of its cached
    embeddings (the same picture sent as PNG or as WebP is one entry). The shape is hashed too:
    Qwen2.5-VL's tiles take each image's own size, and a plain image's pixels read the same
    bytes at 28x56 as at 56x28."""
    digest = hashlib.blake2b(np.asarray(pixels.shape, dtype=np.int64).tobytes(), digest_size=16)
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.digest()
