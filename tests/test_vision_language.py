"""A vision-language checkpoint served end to end through real processes: the worker runs its
language model (the checkpoint's `text_config` and `language_model.*` weights, its vision weights
left to the encoder stage), and text-only requests give HF's greedy tokens from
Gemma3ForConditionalGeneration on the same random weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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


def test_gemma3_prefill_with_images_matches_hf(tiny_gemma3_vlm_dir: Path) -> None:
    """The worker's model given the encoder's embeddings at the image tokens, and each image's
    tokens attending to each other both ways, on a chat with an image in an earlier turn and one
    in the last: HF's logits and greedy tokens (its generate, pixel values in)."""
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from services.common.images import ImageRules
    from services.common.text import Tokenizer
    from services.encoder.vision import VisionEncoder
    from services.gpu_worker.model import ImageRows
    from services.gpu_worker.model_runner import ModelRunner
    from tests.test_model import PlanBuilder, runner_logits

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40 + 9 * i, 50, 3), dtype=np.uint8)) for i in range(2)]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]},
        {"role": "model", "content": "Noise."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    rules = ImageRules.from_dir(tiny_gemma3_vlm_dir)
    tokenizer = Tokenizer(tiny_gemma3_vlm_dir)
    prompt = tokenizer.encode(rules.expand(tokenizer.apply_chat_template(messages), len(images)))
    pixels = torch.from_numpy(np.stack([rules.pixels(image) for image in images]))
    embeddings = VisionEncoder.load(tiny_gemma3_vlm_dir).encode(pixels).reshape(-1, 64)

    processor = AutoProcessor.from_pretrained(tiny_gemma3_vlm_dir)
    inputs = processor(
        text=processor.apply_chat_template(messages, add_generation_prompt=True),
        images=images,
        return_tensors="pt",
    )
    assert inputs["input_ids"][0].tolist() == prompt
    hf = Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3_vlm_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        expected_logits = hf(**inputs).logits[0, -1]
        expected = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)[
            0, len(prompt) :
        ].tolist()

    is_image = np.array(prompt) == rules.image_token_id
    groups = np.where(is_image, (np.cumsum(is_image) - 1) // rules.tokens_per_image, -1).astype(np.int32)
    image_rows = ImageRows(torch.from_numpy(np.flatnonzero(is_image)), embeddings)

    def prefill_logits(with_groups: bool) -> torch.Tensor:
        runner = ModelRunner(tiny_gemma3_vlm_dir, dtype="float32", kv_cache_bytes=2 << 20, block_size=16)
        builder = PlanBuilder(runner.block_size)
        arrays, header = builder.plan([(0, prompt, True)])
        if with_groups:
            arrays["image_groups"] = groups
        runner.validate(arrays, header)
        metas = runner.model.prepare(arrays, header.num_tokens, header.num_seqs)
        ids = torch.from_numpy(arrays["input_ids"].astype(np.int64))
        last = torch.tensor([len(prompt) - 1])
        logits = runner.model.forward(ids, metas, runner.kv_cache, last, images=image_rows)[0]
        return logits, runner, builder

    logits, runner, builder = prefill_logits(with_groups=True)
    torch.testing.assert_close(logits, expected_logits, atol=2e-4, rtol=2e-4)
    got = [int(logits.argmax())]
    for _ in range(NEW_TOKENS - 1):
        got.append(int(runner_logits(runner, builder, [(0, got[-1:], True)])[0].argmax()))
    assert got == expected
    # The two-way attention inside each image matters: causal alone gives other logits.
    causal, _, _ = prefill_logits(with_groups=False)
    assert (causal - expected_logits).abs().max() > 1e-2
