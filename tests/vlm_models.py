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
