"""The encoder's Gemma 3 vision tower and projector against HF transformers' get_image_features on
the same random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.encoder.vision import VisionConfig, VisionEncoder

pytestmark = pytest.mark.timeout(120)


def test_gemma3_image_features_equal_hf(tiny_gemma3_vlm_dir: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    hf = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_vlm_dir, dtype=torch.float32).eval()
    encoder = VisionEncoder.load(tiny_gemma3_vlm_dir)
    torch.manual_seed(1)
    pixels = torch.rand(3, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        expected = hf.model.get_image_features(pixels).pooler_output
    got = encoder.encode(pixels)
    assert got.shape == (3, 4, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Each image's embeddings depend on that image only: batching changes nothing.
    torch.testing.assert_close(encoder.encode(pixels[1:2]), expected[1:2], rtol=1e-4, atol=1e-4)


def test_wrong_pixel_shape_is_refused(tiny_gemma3_vlm_dir: Path) -> None:
    encoder = VisionEncoder.load(tiny_gemma3_vlm_dir)
    with pytest.raises(ValueError, match=r"expected \[n, 3, 64, 64\]"):
        encoder.encode(torch.zeros(1, 3, 32, 32))


def test_a_text_model_has_no_vision_encoder() -> None:
    with pytest.raises(ValueError, match=r"no vision encoder for architectures .*: Gemma 3's, SmolVLM's"):
        VisionConfig.from_dict({"architectures": ["LlamaForCausalLM"]})


def test_vision_configs_whose_image_tokens_do_not_tile_the_patches_are_refused(
    tiny_gemma3_vlm_dir: Path, tiny_idefics3_dir: Path
) -> None:
    gemma = json.loads((tiny_gemma3_vlm_dir / "config.json").read_text())
    assert VisionConfig.from_dict(gemma).tokens_per_tile == gemma["mm_tokens_per_image"]
    with pytest.raises(ValueError, match="mm_tokens_per_image 5 must be a square"):
        VisionConfig.from_dict({**gemma, "mm_tokens_per_image": 5})
    idefics3 = json.loads((tiny_idefics3_dir / "config.json").read_text())
    patches = VisionConfig.from_dict(idefics3).patches_per_side
    with pytest.raises(ValueError, match=f"scale_factor {patches + 1} must divide the {patches} patches"):
        VisionConfig.from_dict({**idefics3, "scale_factor": patches + 1})
