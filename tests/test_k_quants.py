"""A model whose weights are K-quants, mixed per tensor as a Q4_K_M file mixes them: steps of few
rows multiply from the super-blocks themselves and give HF's logits on the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker import loader
from services.gpu_worker.model import CAN_PREPACK
from services.gpu_worker.model_runner import ModelRunner
from tests.test_kernels import has_cpu_kernels, random_k_quant_blocks
from tests.test_model import PlanBuilder, random_ids, runner_logits

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2"),
]

# As llama.cpp's Q4_K_M: most weights Q4_K, v and down Q6_K; gate Q5_K here to cover all three.
FORMATS = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
           "gate_proj": "Q5_K", "up_proj": "Q5_K", "down_proj": "Q6_K"}  # fmt: skip


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (in_features multiples of 256) whose projections are K-quant blocks: the
    dequantized weights in model.safetensors, the blocks in quantized.safetensors, as converting a
    GGUF writes them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("k-quants")
    config = LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    weights = {k: v.numpy() for k, v in load_file(out / "model.safetensors").items()}
    blocks, formats = {}, {}
    for seed, name in enumerate(sorted(weights)):
        projection = name.split(".")[-2]
        if projection not in FORMATS:
            continue
        fmt = FORMATS[projection]
        rows, in_features = weights[name].shape
        blocks[name] = random_k_quant_blocks(fmt, rows, in_features, seed)
        weights[name] = dequantize(blocks[name], GGMLQuantizationType[fmt]).astype(np.float32)
        formats[name] = fmt
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(blocks, str(out / loader.QUANTIZED_FILE), metadata={"formats": json.dumps(formats)})
    return out


def test_k_quant_weights_multiply_from_their_blocks(k_quant_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(k_quant_model, dtype=torch.float32).eval()
    runner = ModelRunner(k_quant_model, dtype="float32", kv_cache_bytes=4 << 20)
    for layer in runner.model.layers:
        qkv, o_proj, gate_up, down = layer.quantized
        assert qkv is None  # q / k Q4_K with v Q6_K: one fused weight cannot mix formats
        assert (o_proj.format, gate_up.format, down.format) == ("Q4_K", "Q5_K", "Q6_K")
        if CAN_PREPACK:  # blocks serve steps of few rows, the prepacked copy wider ones: no plain copy
            assert layer.o_proj.numel() == layer.gate_up.numel() == layer.down.numel() == 0
            assert all(w.is_mkldnn for w in layer.onednn[1:])
            # No blocks: one plain copy, for both the few-rows kernel and oneDNN.
            assert layer.qkv.numel() > 0 and layer.onednn[0] is layer.qkv
    rng = np.random.default_rng(0)
    builder = PlanBuilder()
    histories = {i: random_ids(rng, 9 + i, 300) for i in range(4)}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for num_seqs in (1, 4, 2):  # all-decode steps of few rows: the super-block kernels
        chunks = []
        for i in range(num_seqs):
            histories[i].append(int(rng.integers(0, 300)))
            chunks.append((i, histories[i][-1:], True))
        logits = runner_logits(runner, builder, chunks)
        for row in range(num_seqs):
            with torch.inference_mode():
                expected = hf(torch.tensor([histories[row]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
