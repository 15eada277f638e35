"""Images in chat requests, on the tokenizer's side: decoding with limits, Gemma 3's resize and
normalization against HF's image processor, and the expansion of image placeholders against HF's
processor's input ids, on the tiny random Gemma 3 VLM's own files."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from services.common.images import ImageError, ImageRules, decode_data_url, image_size, open_image, pixels_key
from services.common.text import Tokenizer

pytestmark = pytest.mark.timeout(120)

MAX_BYTES = 1 << 20
MAX_PIXELS = 4096 * 4096


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = len(mode)
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8).squeeze(), mode)


@pytest.mark.parametrize(
    ("image", "fmt"),
    [
        (noise(50, 37), "PNG"),  # neither side the model's, up and down
        (noise(300, 120, seed=1), "JPEG"),
        (noise(70, 90, "RGBA", seed=2), "PNG"),  # transparency goes over white
        (noise(40, 40, seed=3).convert("P"), "GIF"),
    ],
)
def test_gemma3_pixels_equal_hf_image_processor(
    tiny_gemma3_vlm_dir: Path, image: Image.Image, fmt: str
) -> None:
    from transformers import AutoImageProcessor

    hf = AutoImageProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    data = encoded(image, fmt)
    expected = hf(images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    got = rules.pixels(open_image(decode_data_url(data_url(data), MAX_BYTES), MAX_PIXELS))
    assert got.shape == expected.shape == (3, 64, 64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_images", [1, 2])
def test_gemma3_image_tokens_equal_hf_processor(tiny_gemma3_vlm_dir: Path, num_images: int) -> None:
    from transformers import AutoProcessor

    images = [noise(32, 48, seed=i) for i in range(num_images)]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"}]},
        {"role": "model", "content": "A picture."},
        {
            "role": "user",
            "content": [{"type": "image"}] * (num_images - 1) + [{"type": "text", "text": "And?"}],
        },
    ]
    hf = AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    hf_text = hf.apply_chat_template(messages, add_generation_prompt=True)
    expected = hf(text=hf_text, images=images, return_tensors="np")["input_ids"][0].tolist()

    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    tokenizer = Tokenizer(tiny_gemma3_vlm_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(rules.expand(text, [None] * num_images))
    assert ids == expected
    assert ids.count(rules.image_token_id) == 4 * num_images
    with pytest.raises(ImageError, match=f"rendered {num_images} image placeholders for 3 images"):
        rules.expand(text, [None] * 3)


def test_pixels_key_is_by_content_not_encoding(tiny_gemma3_vlm_dir: Path) -> None:
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    image = noise(64, 64)
    as_png = rules.pixels(open_image(encoded(image, "PNG"), MAX_PIXELS))
    as_webp = rules.pixels(open_image(encoded(image, "WEBP", lossless=True), MAX_PIXELS))
    assert pixels_key(as_png) == pixels_key(as_webp)
    assert pixels_key(as_png) != pixels_key(
        rules.pixels(open_image(encoded(noise(64, 64, seed=9), "PNG"), MAX_PIXELS))
    )


PNG = encoded(noise(20, 20), "PNG")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://example.com/cat.png", "must be a data: URL"),
        ("data:text/plain;base64,aGVsbG8=", "media type is text/plain, not an image"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        (data_url(b"\0" * (MAX_BYTES + 10)), f"over the {MAX_BYTES}-byte limit"),
    ],
)
def test_bad_data_urls_are_refused_by_name(url: str, problem: str) -> None:
    with pytest.raises(ImageError, match=problem):
        decode_data_url(url, MAX_BYTES)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (PNG[: len(PNG) // 2], "truncated or corrupt"),
        (b"%PDF-1.4 not a picture", "not an image of a supported type"),
        (encoded(noise(8, 8), "BMP"), "type BMP is not supported"),
        # One colour compresses to little, and would decode to 75 MB; 20000 x 20000 to 1.2 GB,
        # which PIL itself refuses to open.
        (encoded(Image.new("RGB", (5000, 5000)), "PNG"), "5000x5000 is over the 16777216-pixel limit"),
        (encoded(Image.new("L", (20000, 20000)), "PNG"), "over the 16777216-pixel limit"),
    ],
)
def test_bad_images_are_refused_by_name(data: bytes, problem: str) -> None:
    with pytest.raises(ImageError, match=problem):
        open_image(data, MAX_PIXELS)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says `width` x `height` (8-bit RGB) and whose pixel data is a few bytes:
    opening it reads the header up to that data, decoding would fail."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("width", "height", "problem"),
    [
        (5000, 5000, "5000x5000 is over the 16777216-pixel limit"),
        # Over twice PIL's Image.MAX_IMAGE_PIXELS: PIL refuses to open it at all (a
        # DecompressionBombError), which is not an image of an unsupported type either.
        (13400, 13400, r"over the 16777216-pixel limit \(Image size \(179560000 pixels\)"),
    ],
)
def test_image_sizes_over_the_pixel_limit_are_refused_from_the_header(
    width: int, height: int, problem: str
) -> None:
    """The tokenizer's count of an image's tokens reads its size from the header: an image over
    encoder.max_image_pixels is refused there as the encoder refuses it."""
    data = png_header(width, height)
    for read in (image_size, open_image):
        with pytest.raises(ImageError, match=problem):
            read(data, MAX_PIXELS)
    assert image_size(png_header(300, 200), MAX_PIXELS) == (300, 200)


def png_with_chunks(*chunks: tuple[bytes, bytes]) -> bytes:
    """A valid 4x4 PNG with `chunks` (kind, body) between its IHDR and its pixel data."""
    data = encoded(noise(4, 4), "PNG")
    extra = b"".join(
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        for kind, body in chunks
    )
    return data[:33] + extra + data[33:]  # 8 bytes of signature, 25 of IHDR


BOMB = zlib.compress(b"a" * (8 << 20), 9)  # 8 KB that inflate to 8 MB


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ([(b"zTXt", b"k\0\0" + BOMB)], "Decompressed data too large for PngImagePlugin.MAX_TEXT_CHUNK"),
        ([(b"iCCP", b"p\0\0" + BOMB)], "Decompressed data too large for PngImagePlugin.MAX_TEXT_CHUNK"),
        ([(b"pHYs", b"\0")], "Truncated pHYs chunk"),
    ],
    ids=["ztxt-bomb", "iccp-bomb", "truncated-phys"],
)
def test_png_header_chunks_pil_refuses_are_refused_by_name(
    chunks: list[tuple[bytes, bytes]], problem: str
) -> None:
    """PIL's Image.open raises ValueError for these, not OSError: it reached the tokenizer, the
    gateway's /tokenize and the encoder as an internal error (a 500), not the client's 400."""
    data = png_with_chunks(*chunks)
    for read in (image_size, open_image):
        with pytest.raises(
            ImageError, match=rf"^image: its header is corrupt or over PIL's limits \({problem}"
        ):
            read(data, MAX_PIXELS)
    assert open_image(png_with_chunks((b"tEXt", b"Comment\0fine")), MAX_PIXELS).size == (4, 4)


def oriented(fmt: str, orientation: int) -> bytes:
    """A 50x37 image (not square: a quarter turn shows) tagged with EXIF `orientation`."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(noise(50, 37, seed=orientation), fmt, exif=exif.tobytes())


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_an_image_is_turned_upright_by_its_exif_orientation_as_hf_loads_it(
    tiny_gemma3_vlm_dir: Path, tiny_qwen25vl_dir: Path, fmt: str
) -> None:
    """A phone's portrait photo is stored sideways and tagged (EXIF orientation 6). HF's
    load_image, the reference for a data URL, turns every tagged image upright, as any viewer
    shows it; the encoder's pixels are its, and the tokenizer's size from the header (which sets
    Qwen2.5-VL's image tokens) is the upright one too. Before, the model was given the image as
    stored: sideways, mirrored or upside down."""
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    hf = AutoImageProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    for orientation in range(1, 9):
        data = oriented(fmt, orientation)
        reference = load_image(data_url(data))
        assert reference.size == ((50, 37) if orientation < 5 else (37, 50)), orientation
        got = open_image(data, MAX_PIXELS)
        assert got.size == reference.size == image_size(data, MAX_PIXELS), orientation
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference))
        expected = hf(images=reference, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(rules.pixels(got), expected, rtol=0, atol=1e-6)
    qwen = ImageRules.from_dir(tiny_qwen25vl_dir)
    sideways = oriented(fmt, 6)
    assert qwen.tile_tokens(image_size(sideways, MAX_PIXELS)) == [
        qwen.pixels_tokens(tile) for tile in qwen.tiles(open_image(sideways, MAX_PIXELS))
    ]


def test_an_image_type_the_encoder_refuses_is_refused_from_the_header() -> None:
    """The tokenizer reads the size of a Qwen2.5-VL image from its header: a type the encoder
    does not decode (BMP, TIFF) is refused there too, as the encoder refuses it, rather than
    counted and sent on to be refused by the encoder."""
    for image, fmt in ((noise(8, 8), "BMP"), (noise(8, 8), "TIFF")):
        for read in (image_size, open_image):
            with pytest.raises(ImageError, match=f"type {fmt} is not supported"):
                read(encoded(image, fmt), MAX_PIXELS)
