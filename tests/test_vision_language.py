"""A vision-language checkpoint served end to end through real processes: the worker runs its
language model (the checkpoint's `text_config` and `language_model.*` weights, its vision weights
left to the encoder stage), and text-only requests give HF's greedy tokens from
Gemma3ForConditionalGeneration on the same random weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
import torch

from ipc.embedding_cache import EmbeddingCache
from ipc.endpoints import SHM_PREFIX
from ipc.shm import new_run_id
from tests.test_family_serving import served_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 10


def hf_vlm_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    """HF's greedy continuation by full forwards of the whole vision-language model."""
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_gemma3_vlm_text_only_served_greedy_matches_hf(tiny_gemma3_vlm_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, n).tolist() for n in (30, 9)]  # one longer than the window
    expected = [hf_vlm_greedy(tiny_gemma3_vlm_dir, p) for p in prompts]
    overrides = (f"model.path={tiny_gemma3_vlm_dir}", "model.dtype=float32", "model.max_model_len=256")
    assert served_greedy(tmp_path / "run", overrides, prompts, NEW_TOKENS) == expected


@pytest.fixture
def embedding_cache_name() -> Iterator[str]:
    name = f"/{SHM_PREFIX}{new_run_id()}-embeds-0"
    yield name
    posix_ipc.unlink_shared_memory(name)


def test_gemma3_prefill_with_images_matches_hf(tiny_gemma3_vlm_dir: Path, embedding_cache_name: str) -> None:
    """The worker reads an encoder's embeddings from its shared-memory cache by the plan's image
    arrays, puts them at the image tokens, and lets each image's tokens attend to each other both
    ways, on a chat with an image in an earlier turn and one in the last: HF's logits and greedy
    tokens (its generate, pixel values in). An evicted image fails the step by name."""
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from services.common.images import ImageRules, pixels_key
    from services.common.text import Tokenizer
    from services.encoder.vision import VisionEncoder
    from services.gpu_worker.model import ImageRows
    from services.gpu_worker.model_runner import InvalidPlan, ModelRunner
    from tests.test_model import PlanBuilder

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40 + 9 * i, 50, 3), dtype=np.uint8)) for i in range(2)]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]},
        {"role": "model", "content": "Noise."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    tokenizer = Tokenizer(tiny_gemma3_vlm_dir)
    prompt = tokenizer.encode(rules.expand(tokenizer.apply_chat_template(messages), [None] * len(images)))
    pixels = np.stack([rules.pixels(image) for image in images])
    embeddings = VisionEncoder.load(tiny_gemma3_vlm_dir).encode(torch.from_numpy(pixels))

    processor = AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt
    hf = Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3_vlm_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        expected_logits = hf(**inputs).logits[0, -1]
        expected = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)[
            0, len(prompt) :
        ].tolist()

    # The encoder's side: the embeddings in its cache, by the images' content keys.
    cache = EmbeddingCache.create_or_attach(embedding_cache_name, 2, rules.tokens_per_tile, 64)
    keys = [pixels_key(p) for p in pixels]
    refs = [cache.put(key, rows.numpy()) for key, rows in zip(keys, embeddings, strict=True)]
    is_image = np.array(prompt) == rules.image_token_id
    starts = np.flatnonzero(is_image)[:: rules.tokens_per_tile].astype(np.int32)
    image_arrays = {
        "image_groups": np.where(is_image, (np.cumsum(is_image) - 1) // rules.tokens_per_tile, -1).astype(
            np.int32
        ),
        "image_starts": starts,
        "image_encoders": np.zeros(2, np.int32),
        "image_slots": np.array([r.slot for r in refs], np.int32),
        "image_sequences": np.array([r.sequence for r in refs], np.int64),
        "image_keys": np.frombuffer(b"".join(keys), np.uint8).reshape(2, 16),
    }

    def new_runner() -> tuple[ModelRunner, PlanBuilder]:
        runner = ModelRunner(
            tiny_gemma3_vlm_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=16,
            embedding_caches=lambda encoder: embedding_cache_name,
        )  # fmt: skip
        return runner, PlanBuilder(runner.block_size)

    def prefill_logits(arrays_added: dict) -> torch.Tensor:
        """The model's logits of the prompt's last token, the image rows given as they are."""
        runner, builder = new_runner()
        arrays, header = builder.plan([(0, prompt, True)])
        arrays.update(arrays_added)
        runner.validate(arrays, header)
        metas = runner.model.prepare(arrays, header.num_tokens, header.num_seqs)
        ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
        rows = ImageRows(torch.from_numpy(np.flatnonzero(is_image)), embeddings.reshape(-1, 64))
        return runner.model.forward(
            ids, metas, runner.kv_cache, torch.tensor([len(prompt) - 1]), images=rows
        )[0]

    torch.testing.assert_close(prefill_logits(image_arrays), expected_logits, atol=2e-4, rtol=2e-4)
    # The two-way attention inside each image matters: causal alone gives other logits.
    assert (prefill_logits({}) - expected_logits).abs().max() > 1e-2

    # The worker's whole step, the embeddings read from the cache by the plan.
    runner, builder = new_runner()
    got = [int(runner.execute(*plan_with(builder.plan([(0, prompt, True)]), image_arrays))["sampled_ids"][0])]
    for _ in range(NEW_TOKENS - 1):
        got.append(int(runner.execute(*builder.plan([(0, got[-1:], True)]))["sampled_ids"][0]))
    assert got == expected

    # Both images evicted (their slots rewritten) before a step that reads them: it fails, naming the first.
    cache.put(b"another image...", embeddings[0].numpy())
    cache.put(b"and one more....", embeddings[0].numpy())
    runner, builder = new_runner()
    with pytest.raises(InvalidPlan, match="image 0: its embeddings are no longer in encoder 0's cache"):
        runner.execute(*plan_with(builder.plan([(0, prompt, True)]), image_arrays))
    cache.close()


def plan_with(plan: tuple[dict, object], arrays: dict) -> tuple[dict, object]:
    step, header = plan
    return {**step, **arrays}, header
