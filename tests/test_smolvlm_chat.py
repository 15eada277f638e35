"""SmolVLM and Idefics3 chats with images through a whole run (issue 36): the real `openai` client
sends data URLs, the tokenizer expands each image into its tiles' token runs as HF's processor does
(a grid of tiles and a global one with image splitting, the global one alone without), the encoder
stage runs the shared SigLIP tower and the pixel-shuffle connector on each tile, and the worker's
Llama reads the embeddings causally; the greedy tokens and logprobs are HF's on the same random
weights. `/tokenize` counts HF's prompt tokens; bad images are 400s and the run keeps serving. With
splitting, http image URLs serve and count what the same images as data URLs do."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.images import ImageRules, open_image
from services.encoder.vision import VisionEncoder
from tests.harness import assert_clean, brigade_run
from tests.test_e2e import gateway_url
from tests.test_image_chat import NEW_TOKENS, assert_hfs, data_url, png, served, tokenize_count
from tests.test_image_fetch import MAX_BYTES, assert_http_images_serve_as_data_urls

pytestmark = [pytest.mark.timeout(900)]

TOKENS_PER_TILE = 4  # the fixtures' 4x4 patches shuffled by 2


def hf_inputs(model_dir: Path, turns: list[tuple[str, list[str | bytes]]]) -> dict[str, torch.Tensor]:
    """HF's input ids, pixel values and pixel mask for the chat. Idefics3: its processor.
    SmolVLM: its image processor, and the prompt expanded by its processor module's own image
    prompt function (SmolVLMProcessor itself needs torchvision, which is not installed here)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    messages = [
        {"role": role, "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]}
        for role, parts in turns
    ]  # fmt: skip
    images = [Image.open(io.BytesIO(p)) for _, parts in turns for p in parts if isinstance(p, bytes)]
    if (model_dir / "processor_config.json").exists():  # the Idefics3 fixture
        processor = AutoProcessor.from_pretrained(model_dir)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        return processor(text=text, images=[images], return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = AutoImageProcessor.from_pretrained(model_dir)(
        images=[images], return_row_col_info=True, return_tensors="pt"
    )
    pieces = text.split("<image>")
    expanded = pieces[0] + "".join(
        get_image_prompt_string(rows, cols, TOKENS_PER_TILE, "<fake_token_around_image>", "<image>", "<global-img>")
        + piece
        for rows, cols, piece in zip(pixels["rows"][0], pixels["cols"][0], pieces[1:], strict=True)
    )  # fmt: skip
    return {"input_ids": tokenizer(expanded, return_tensors="pt")["input_ids"], **pixels}


def hf_greedy(
    model_dir: Path, turns: list[tuple[str, list[str | bytes]]]
) -> tuple[int, list[int], np.ndarray]:
    """HF's prompt length, greedy tokens and their logprobs (full forwards with the pixels)."""
    import transformers

    inputs = hf_inputs(model_dir, turns)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    architecture = getattr(transformers, config.architectures[0])
    hf = architecture.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = inputs["input_ids"]
    num_prompt = ids.shape[1]
    logprobs = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = hf(
                input_ids=ids,
                pixel_values=inputs["pixel_values"],
                pixel_attention_mask=inputs["pixel_attention_mask"],
            ).logits[0, -1]
            ids = torch.cat([ids, logits.argmax().reshape(1, 1)], dim=1)
            logprobs.append(float(torch.log_softmax(logits, -1).max()))
    return num_prompt, ids[0, num_prompt:].tolist(), np.array(logprobs)


def serve_and_compare(
    model_dir: Path, run_dir: Path, cases: dict[str, list], bad_images: dict[str, str]
) -> None:
    """Each chat of `cases` served through one run gives HF's tokens, `/tokenize` counts HF's
    prompt, and each bad image is a 400 matching its message, after which the run still serves."""
    import openai

    expected = {name: hf_greedy(model_dir, turns) for name, turns in cases.items()}
    # The image matters to the output (a tiny random model's greedy tokens may not show it).
    assert np.abs(expected["one image"][2] - expected["another image"][2]).max() > 2e-2
    overrides = (
        f"model.path={model_dir}", "model.dtype=float32", "model.max_model_len=512",
        "encoder.replicas=1", f"encoder.max_image_bytes={MAX_BYTES}", "encoder.remote_image_timeout_s=2",
        "gateway.served_model_name=tiny",
    )  # fmt: skip
    with brigade_run(run_dir, *overrides) as run:
        url = gateway_url(run)
        api = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        for name, turns in cases.items():
            assert_hfs(served(api, turns), expected[name])
            assert tokenize_count(url, turns) == expected[name][0], name
        for message, image_url in bad_images.items():
            content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Hi"}]
            with pytest.raises(openai.BadRequestError, match=message):
                api.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2
                )
        if ImageRules.from_dir(model_dir).needs_sizes:
            assert_http_images_serve_as_data_urls(run, "<image>")
        first = next(iter(cases))
        assert_hfs(served(api, cases[first]), expected[first])
    assert_clean(run_dir)


IMAGE_A, IMAGE_B, IMAGE_C = png(50, 37, seed=0), png(100, 20, seed=1), png(30, 45, seed=2)
CASES = {
    "one image": [("user", [IMAGE_A, "What is in this picture?"])],
    "another image": [("user", [IMAGE_C, "What is in this picture?"])],
    "two images": [("user", ["Compare", IMAGE_A, "with", IMAGE_B])],
    "an earlier turn": [("user", [IMAGE_C, "Look."]), ("assistant", ["Noise."]), ("user", ["What was it?"])],
}


@pytest.mark.slow
def test_smolvlm_chats_with_split_images_give_hfs_tokens(tiny_smolvlm_dir: Path, tmp_path: Path) -> None:
    rules = ImageRules.from_dir(tiny_smolvlm_dir)
    # Splitting on: 50x37 is a 2x2 grid and a global tile, 100x20 a 1x2 grid and a global tile.
    assert [len(rules.tile_tokens(size)) for size in ((50, 37), (100, 20))] == [5, 3]
    one, two = (
        hf_inputs(tiny_smolvlm_dir, CASES["one image"]),
        hf_inputs(tiny_smolvlm_dir, CASES["two images"]),
    )
    assert int((one["input_ids"] == rules.image_token_id).sum()) == 5 * TOKENS_PER_TILE
    assert int((two["input_ids"] == rules.image_token_id).sum()) == 8 * TOKENS_PER_TILE
    # The tiles are HF's pixels (to float32 rounding), and the encoder's embeddings HF's connector output.
    tiles = np.stack(rules.tiles(open_image(IMAGE_A, 1 << 20)))
    np.testing.assert_allclose(tiles, one["pixel_values"][0].numpy(), rtol=0, atol=1e-6)
    import transformers

    hf = transformers.SmolVLMForConditionalGeneration.from_pretrained(tiny_smolvlm_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf.get_image_features(
            pixel_values=one["pixel_values"], pixel_attention_mask=one["pixel_attention_mask"]
        ).pooler_output[0]
    got = VisionEncoder.load(tiny_smolvlm_dir).encode(torch.from_numpy(tiles)).reshape(want.shape)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, format="BMP")
    bad_images = {
        "truncated or corrupt": data_url(IMAGE_A[: len(IMAGE_A) // 2]),
        "not an image": data_url(b"hello", "image/png"),  # refused by the tokenizer's size read
        "type BMP is not supported": data_url(bmp.getvalue(), "image/bmp"),
    }
    serve_and_compare(tiny_smolvlm_dir, tmp_path / "run", CASES, bad_images)


@pytest.mark.slow
def test_idefics3_chats_without_splitting_give_hfs_tokens(tiny_idefics3_dir: Path, tmp_path: Path) -> None:
    rules = ImageRules.from_dir(tiny_idefics3_dir)
    assert not rules.needs_sizes and len(rules.tile_tokens(None)) == 1  # the global tile alone
    bad_images = {"truncated or corrupt": data_url(IMAGE_A[: len(IMAGE_A) // 2])}
    serve_and_compare(tiny_idefics3_dir, tmp_path / "run", CASES, bad_images)


def test_admission_expands_each_image_into_its_tiles(tiny_smolvlm_dir: Path, tiny_idefics3_dir: Path) -> None:
    """Without a run: the tokenizer counts a split image's tiles from its header and names each
    tile's run; an http(s) image's once it is fetched (test_image_fetch.py has more of that)."""
    from ipc import messages as m
    from services.common.image_fetch import RemoteImages
    from services.common.images import image_rules_of
    from services.common.text import Tokenizer
    from services.tokenizer.core import TokenizerCore

    remote = RemoteImages(max_bytes=1 << 20, timeout_s=5.0, max_redirects=0)

    def admit(model_dir: Path, *parts: m.ImagePart | m.TextPart):
        core = TokenizerCore(
            Tokenizer(model_dir), 0, 1, max_model_len=512, max_prompt_chars=1 << 20, default_max_tokens=4,
            image_rules=image_rules_of(model_dir), num_encoders=1, max_image_bytes=1 << 20, remote_images=remote,
        )  # fmt: skip
        chat = m.Generate(
            "r", messages=[m.ChatMessage("user", list(parts))], params=m.SamplingParams(max_tokens=2)
        )
        return core.admit(b"c", chat)

    a, b = m.ImagePart(data_url(IMAGE_A)), m.ImagePart(data_url(IMAGE_B))
    entry = admit(tiny_smolvlm_dir, a, m.TextPart("and"), b)
    assert entry.is_encoding and len(entry.image_starts) == 5 + 3
    prompt = m.unpack_ids(entry.submit.prompt_ids)
    image_token = ImageRules.from_dir(tiny_smolvlm_dir).image_token_id
    for start in entry.image_starts:
        assert (prompt[start : start + TOKENS_PER_TILE] == image_token).all()
    # Without splitting, an image is one tile whatever its size.
    entry = admit(tiny_idefics3_dir, a, m.TextPart("and"), b)
    assert len(entry.image_starts) == 2
