"""The whole pipeline on a GPU (runs only where CUDA is; `benchmarks/gpu_check.py` runs it): supervisor, tokenizer, scheduler, a CUDA worker and detokenizer as real processes, a random
Llama whose greedy tokens must be HF's (float32 on the CPU), in batches that the worker's
captured CUDA graphs replay padded, through a prefix hit and a SIGKILL of the worker mid-stream
(the restarted worker captures its graphs again and the stream continues with the same tokens).

The model needs a tokenizer and the GPU machine has no SmolLM2: a byte-level one is made here."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from client import Client
from tests.conftest import save_random_model
from tests.harness import assert_clean, brigade_run, hf_greedy

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 24
GRAPHS_CAPTURED = "CUDA graphs of decode steps captured"
GRAPH_REPLAYED = "the first decode step replayed from a CUDA graph"  # once per worker process


def byte_tokenizer(out: Path) -> int:
    """A byte-level BPE without merges (one token per byte) and an eos: its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: index for index, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tokenizer.get_vocab_size()


@pytest.fixture(scope="module")
def gpu_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("gpu-llama")
    vocab_size = byte_tokenizer(out)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=vocab_size - 1, tie_word_embeddings=False,
    )  # fmt: skip
    return save_random_model(config, out, seed=5, std=0.08)


def test_served_on_cuda_with_graphs_gives_hfs_tokens(gpu_llama_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 255, n).tolist() for n in (9, 30, 17, 5, 40)]
    long_prompt = rng.integers(1, 255, 12).tolist()
    expected = {tuple(p): hf_greedy(gpu_llama_dir, p, NEW_TOKENS) for p in prompts}
    long_expected = hf_greedy(gpu_llama_dir, long_prompt, 4 * NEW_TOKENS)
    run_dir = tmp_path / "run"
    overrides = (
        f"model.path={gpu_llama_dir}", "model.dtype=float32", "model.max_model_len=256",
        "engine.device=cuda", "engine.gpu_memory_utilization=0.3", "engine.cuda_graph_max_batch=8",
    )  # fmt: skip
    log = run_dir.with_name(run_dir.name + ".log")

    def greedy(prompt: list[int], tokens: int = NEW_TOKENS) -> list[int]:
        with Client(run_dir) as client:
            return client.generate(
                prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True, timeout=120
            ).token_ids

    with brigade_run(run_dir, *overrides) as run:
        assert log.read_text().count(GRAPHS_CAPTURED) == 1
        # Five at once (decode batches of 5, 4, ... padded to 8 and 4), then three, then a
        # repeated prompt (a prefix hit).
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(greedy, prompts)) == [expected[tuple(p)] for p in prompts]
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(greedy, prompts[:3])) == [expected[tuple(p)] for p in prompts[:3]]
        assert greedy(prompts[1]) == expected[tuple(prompts[1])]
        assert log.read_text().count(GRAPH_REPLAYED) == 1

        # SIGKILL the worker after the stream's first token: the restarted worker captures its
        # graphs again and the request continues with the same tokens.
        worker = run.stage_pids("gpu_worker")[0]
        tokens: list[int] = []
        with Client(run_dir) as client:
            for delta in client.stream(
                long_prompt, max_tokens=4 * NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=240
            ):
                if not tokens:
                    os.kill(worker, signal.SIGKILL)
                tokens += delta.token_ids
        assert tokens == long_expected
        run.wait_for_restart([worker])
        assert log.read_text().count(GRAPHS_CAPTURED) == 2
        assert greedy(prompts[0]) == expected[tuple(prompts[0])]
        assert log.read_text().count(GRAPH_REPLAYED) == 2
    assert_clean(run_dir)
