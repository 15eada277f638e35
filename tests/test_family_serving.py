"""A non-Llama family served end to end through real processes (supervisor, frontend, scheduler,
worker, detokenizer): a random Gemma 2 (sliding-window layers shorter than the prompts, soft caps,
sandwich norms) with SmolLM2's tokenizer, whose greedy tokens must be HF's."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from client import Client
from tests.conftest import TINY_VOCAB_SIZE
from tests.harness import assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma2_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out = tmp_path_factory.mktemp("gemma2-serving")
    config = Gemma2Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=10, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    """HF's greedy continuation by full forwards (its masks, no HF KV cache)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_gemma2_served_greedy_matches_hf(gemma2_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (30, 17, 45)
    ]  # all longer than the window
    expected = [hf_greedy(gemma2_dir, p) for p in prompts]
    run_dir = tmp_path / "run"
    with brigade_run(run_dir, f"model.path={gemma2_dir}", "model.dtype=float32", "model.max_model_len=256"):

        def one(prompt: list[int]) -> list[int]:
            with Client(run_dir) as client:
                result = client.generate(
                    prompt, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=300
                )
                return result.token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, prompts))
    assert got == expected
    assert_clean(run_dir)
