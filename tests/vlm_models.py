"""Random vision-language checkpoints, written as HF's own save_pretrained writes them: the tests'
tiny one (tests/conftest.py) and the benchmarks' larger ones (benchmarks/encoder_bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A Gemma-3-like chat template, small enough to read: an image part renders as its placeholder.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
TINY_GEMMA3_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip
TINY_GEMMA3_VISION = dict(
    image_size=64, patch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
)  # fmt: skip


def write_gemma3_vlm(
    out: Path,
    tokenizer_dir: Path,
    text: dict[str, Any] = TINY_GEMMA3_TEXT,
    vision: dict[str, Any] = TINY_GEMMA3_VISION,
    tokens_per_image: int = 4,
) -> Path:
    """A random `Gemma3ForConditionalGeneration` in `out` (a SigLIP tower of `vision`'s sizes,
    pooled to `tokens_per_image` image tokens, and a language model of `text`'s), with the
    tokenizer of `tokenizer_dir` plus Gemma 3's three image tokens, and a Gemma3Processor beside
    it. The defaults are the tests' tiny one."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS)})
    tokenizer.save_pretrained(out)
    boi, image, eoi = tokenizer.convert_tokens_to_ids(list(GEMMA3_IMAGE_TOKENS))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        out,
        extra_special_tokens=dict(
            zip(("boi_token", "image_token", "eoi_token"), GEMMA3_IMAGE_TOKENS, strict=True)
        ),
    )
    side = vision["image_size"]
    image_processor = Gemma3ImageProcessorPil(
        size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    Gemma3Processor(
        image_processor, tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=tokens_per_image
    ).save_pretrained(out)
    config = Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer), max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text,
        ),
        vision_config=dict(vision_use_head=False, **vision),
        mm_tokens_per_image=tokens_per_image, boi_token_index=boi, image_token_index=image, eoi_token_index=eoi,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # wider than HF's init and every norm away from its identity, so each one matters
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma's RMSNorms scale by (1 + w), the tower's LayerNorms by w.
                is_gemma_norm = "language_model" in name or "mm_soft" in name
                p.uniform_(-0.5, 0.5) if is_gemma_norm else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


# A Qwen2-VL-like chat template, small enough to read: an image part renders as Qwen's vision run,
# whose <|image_pad|> the processor repeats once per image token.
QWEN25VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN25VL_IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
TINY_QWEN25VL_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)  # fmt: skip
# 14-pixel patches merged 2x2 into a token; windows of 2x2 tokens (56 pixels) in blocks 0 and 2,
# the whole image in blocks 1 and 3.
TINY_QWEN25VL_VISION = dict(
    depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
    spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1, 3],
)  # fmt: skip


def write_qwen25vl(
    out: Path,
    tokenizer_dir: Path,
    text: dict[str, Any] = TINY_QWEN25VL_TEXT,
    vision: dict[str, Any] = TINY_QWEN25VL_VISION,
    max_image_tokens: int = 64,
) -> Path:
    """A random `Qwen2_5_VLForConditionalGeneration` in `out` (a vision tower of `vision`'s
    sizes and a language model of `text`'s), with the tokenizer of `tokenizer_dir` plus Qwen's
    vision tokens, and a Qwen2-VL image processor (images resized to 4 to `max_image_tokens`
    image tokens) beside it. Qwen2_5_VLProcessor needs torchvision (its video processor), which
    this environment lacks: the image processor and the chat template are saved alone."""
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN25VL_IMAGE_TOKENS)})
    tokenizer.chat_template = QWEN25VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    factor = vision["patch_size"] * vision["spatial_merge_size"]
    Qwen2VLImageProcessorPil(
        min_pixels=4 * factor * factor, max_pixels=max_image_tokens * factor * factor,
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
    ).save_pretrained(out)  # fmt: skip
    start, image, end, video = tokenizer.convert_tokens_to_ids(list(QWEN25VL_IMAGE_TOKENS))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **text,
        ),
        vision_config=dict(out_hidden_size=text["hidden_size"], **vision),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # wider than HF's init and every norm away from its identity, so each one matters
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name or "ln_q" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out
