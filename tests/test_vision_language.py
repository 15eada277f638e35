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
