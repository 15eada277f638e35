"""Non-Llama families served end to end through real processes (supervisor, tokenizer, scheduler,
worker, detokenizer) with SmolLM2's tokenizer, whose greedy tokens must be HF's: a random Gemma 2
(sliding-window layers shorter than the prompts, soft caps, sandwich norms), a random Mistral
whose sequences fit the KV pool only because blocks behind the window are freed, and a random
Phi-3 with LongRoPE served past its original length."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from client import Client
from tests.conftest import TINY_VOCAB_SIZE, save_random_model
from tests.harness import assert_clean, brigade_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma2_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma2Config

    out = tmp_path_factory.mktemp("gemma2-serving")
    config = Gemma2Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=10, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return save_random_model(config, out, seed=3, std=0.1, tokenizer_from=smollm2_dir)


def hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int = NEW_TOKENS, **load_options) -> list[int]:
    """HF's greedy continuation by full forwards (its masks, no HF KV cache); `load_options` go to
    from_pretrained (a quantization_config)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **load_options
    ).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def served_greedy(
    run_dir: Path, overrides: tuple[str, ...], prompts: list[list[int]], new_tokens: int, then: tuple = ()
) -> list[list[int]]:
    """Greedy tokens from a Brigade run under `overrides`: `prompts` sent at once, then each of
    `then` alone (a repeated prompt hits the prefix cache); the run leaves nothing behind."""
    with brigade_run(run_dir, *overrides):

        def one(prompt: list[int]) -> list[int]:
            with Client(run_dir) as client:
                result = client.generate(
                    prompt, max_tokens=new_tokens, temperature=0.0, ignore_eos=True, timeout=300
                )
                return result.token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, prompts))
        got += [one(prompt) for prompt in then]
    assert_clean(run_dir)
    return got


def test_gemma2_served_greedy_matches_hf(gemma2_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (30, 17, 45)
    ]  # all longer than the window
    expected = [hf_greedy(gemma2_dir, p) for p in prompts]
    overrides = (f"model.path={gemma2_dir}", "model.dtype=float32", "model.max_model_len=256")
    assert served_greedy(tmp_path / "run", overrides, prompts, NEW_TOKENS) == expected


@pytest.fixture(scope="module")
def mistral_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Mistral whose KV blocks are large (8 KV heads x 64): 1 MiB of cache holds just 8
    blocks of 16 tokens, so blocks released behind the window are soon handed to other sequences."""
    from transformers import MistralConfig

    out = tmp_path_factory.mktemp("mistral-serving")
    config = MistralConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, sliding_window=20,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    return save_random_model(config, out, seed=4, std=0.05, tokenizer_from=smollm2_dir)


@pytest.mark.timeout(900)  # HF's reference by full forwards, 150 of them, on a loaded host
def test_mistral_served_in_a_pool_its_sequences_only_fit_windowed(mistral_dir: Path, tmp_path: Path) -> None:
    """Three sequences of up to 30 + 50 tokens at once in 8 blocks of 16 (128 tokens; 15 blocks
    without the window): the scheduler frees the blocks behind the 20-token window and other
    sequences soon reuse them while their ids stay in the first one's table; a repeated prompt
    hits the prefix cache. Greedy tokens must be HF's (a read of a reused block would not be)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (30, 25, 18)]
    prompts.append(list(prompts[0]))  # a prefix-cache hit on the first one's blocks
    new_tokens = 50
    expected = [hf_greedy(mistral_dir, p, new_tokens) for p in prompts[:3]]
    expected.append(expected[0])
    overrides = (
        f"model.path={mistral_dir}", "model.dtype=float32", "model.max_model_len=128",
        "engine.kv_cache_mib=1", "engine.block_size=16",
    )  # fmt: skip
    got = served_greedy(tmp_path / "run", overrides, prompts[:3], new_tokens, then=(prompts[3],))
    assert got == expected


@pytest.fixture(scope="module")
def phi3_longrope_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Phi-3 with LongRoPE whose original length is 32 of its 128 positions."""
    from transformers import Phi3Config

    out = tmp_path_factory.mktemp("phi3-longrope-serving")
    rng = np.random.default_rng(6)
    config = Phi3Config(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1 + 3 * rng.random(8)).tolist(), "long_factor": (1 + 3 * rng.random(8)).tolist(),
        },
    )  # fmt: skip
    return save_random_model(config, out, seed=5, std=0.1, tokenizer_from=smollm2_dir)


def test_phi3_longrope_served_past_its_original_length_matches_hf(
    phi3_longrope_dir: Path, tmp_path: Path
) -> None:
    """Served up to max_position_embeddings (128), not the original 32: a prompt whose generation
    passes 32 (the scheduler recomputes it in the long regime, as the worker's hello told it to)
    and one longer than 32, in chunks of 16, greedy tokens HF's."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, TINY_VOCAB_SIZE, n).tolist() for n in (24, 50)]
    new_tokens = 16
    expected = [hf_greedy(phi3_longrope_dir, p, new_tokens) for p in prompts]
    overrides = (
        f"model.path={phi3_longrope_dir}", "model.dtype=float32", "model.max_model_len=128",
        "engine.max_num_batched_tokens=16",
    )  # fmt: skip
    assert served_greedy(tmp_path / "run", overrides, prompts, new_tokens) == expected
