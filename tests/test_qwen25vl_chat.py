"""Qwen2.5-VL chats through a whole run (issue 36): the real `openai` client sends data URLs, the
tokenizer expands each image into its <|image_pad|> run (as long as its resized grid), the encoder
stage runs the windowed tower and patch merger, and the worker's Qwen2 rotates by M-RoPE's 3-D
positions (a text-only chat by plain ones); the greedy tokens and logprobs are HF generate's on
the same random weights. `/tokenize` counts HF's prompt tokens; a too-elongated image and a video
are 400s and the run keeps serving; http image URLs serve and count what the same images as data
URLs do. The encoder's cache is smaller than two of the largest images (it held one, when each
image took a slot of the largest's size): the small images of a chat take only the pages their
tokens need, so two in a request and the images of all the chats fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ipc.embedding_cache import EmbeddingCache
from services.common.images import ImageRules, open_image, pixels_key
from services.stage import read_run_info, run_endpoints
from tests.harness import assert_clean, brigade_run
from tests.test_e2e import gateway_url
from tests.test_image_chat import assert_hfs, data_url, png, served, tokenize_count
from tests.test_image_fetch import MAX_BYTES, assert_http_images_serve_as_data_urls
from tests.test_qwen25vl import hf_generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

IMAGE_A, IMAGE_B, IMAGE_C = png(150, 100, seed=0), png(50, 37, seed=1), png(90, 200, seed=2)
CASES = {
    "one image": [("user", [IMAGE_A, "What is in this picture?"])],
    "another image": [("user", [IMAGE_C, "What is in this picture?"])],
    "two images": [("user", ["Compare", IMAGE_A, "with", IMAGE_B])],
    "an earlier turn": [("user", [IMAGE_C, "Look."]), ("assistant", ["Noise."]), ("user", ["What was it?"])],
    "text alone": [("user", ["What is in a picture?"])],
}


def test_qwen25vl_chats_give_hfs_tokens(tiny_qwen25vl_dir: Path, tmp_path: Path) -> None:
    import openai

    expected = {name: hf_generate(tiny_qwen25vl_dir, turns) for name, turns in CASES.items()}
    # The image matters to the output (a tiny random model's greedy tokens may not show it).
    assert np.abs(expected["one image"][2] - expected["another image"][2]).max() > 2e-2
    rules = ImageRules.from_dir(tiny_qwen25vl_dir)
    width = 64  # the tiny model's hidden size
    largest_image_bytes = EmbeddingCache.segment_bytes(1, rules.tokens_per_tile, width)
    cache_bytes = 2 * largest_image_bytes - 1
    overrides = (
        f"model.path={tiny_qwen25vl_dir}", "model.dtype=float32", "model.max_model_len=512",
        "encoder.replicas=1", f"encoder.max_image_bytes={MAX_BYTES}", "encoder.remote_image_timeout_s=2",
        f"encoder.cache_bytes={cache_bytes}", "gateway.served_model_name=tiny",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, *overrides) as run:
        cache = EmbeddingCache.attach(run_endpoints(run_dir, read_run_info(run_dir)).embedding_cache(0))
        assert cache.page_rows == rules.fewest_tile_tokens == 4
        assert cache.max_rows < 2 * rules.tokens_per_tile
        url = gateway_url(run)
        api = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        for name, turns in CASES.items():
            assert_hfs(served(api, turns), expected[name])
            assert tokenize_count(url, turns) == expected[name][0], name
        # Every image served is still cached, each in the pages its tokens need.
        held = cache.held()
        for image in (IMAGE_A, IMAGE_B, IMAGE_C):
            [pixels] = rules.tiles(open_image(image, 1 << 20))
            ref = held[pixels_key(pixels)]
            assert cache.read(ref, pixels_key(pixels)).shape == (rules.pixels_tokens(pixels), width)
        cache.close()
        content = [
            {"type": "image_url", "image_url": {"url": data_url(png(400, 1, seed=3))}},
            {"type": "text", "text": "Hi"},
        ]
        with pytest.raises(openai.BadRequestError, match="more than 200 times as long"):
            api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2
            )
        # Videos are not read: a video part is refused by its type.
        video = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]
        with pytest.raises(openai.BadRequestError, match="got type 'video_url'"):
            api.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": video}], max_tokens=2
            )
        assert_http_images_serve_as_data_urls(run, "<|image_pad|>")
        # The same image again: its embeddings from the encoder's cache, its KV from the prefix cache.
        assert_hfs(served(api, CASES["one image"]), expected["one image"])
    assert_clean(tmp_path / "run")
