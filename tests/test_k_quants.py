"""A model whose weights are K-quants, mixed per tensor as a Q4_K_M file mixes them (also within a
fused weight): steps of few rows multiply from the super-blocks themselves and give HF's logits on
the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker import loader
from services.gpu_worker.model import CAN_PREPACK, MixedQuantizedWeight
from services.gpu_worker.model_runner import ModelRunner
from tests.test_kernels import has_cpu_kernels, random_k_quant_blocks
from tests.test_model import PlanBuilder, random_ids, runner_logits

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not has_cpu_kernels(), reason="no C++ compiler / AVX2"),
]

# As llama.cpp's Q4_K_M: most weights Q4_K, v and down Q6_K (so the fused qkv mixes two formats);
# gate Q5_K here to cover all three, and to mix the fused gate_up too.
FORMATS = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
           "gate_proj": "Q5_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}  # fmt: skip


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


@pytest.mark.usefixtures("cpu_isa")
def test_k_quant_weights_multiply_from_their_blocks(
    k_quant_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of few rows from the mixed-format blocks, each layer as one C++ op (its fused
    weights passed as their parts) and op by op: both give HF's logits and each other's."""
    from transformers import AutoModelForCausalLM

    from kernels import cpu_ops

    hf = AutoModelForCausalLM.from_pretrained(k_quant_model, dtype=torch.float32).eval()
    runners = [ModelRunner(k_quant_model, dtype="float32", kv_cache_bytes=4 << 20) for _ in range(2)]
    assert runners[0].model.has_one_op_layers
    runners[1].model.has_one_op_layers = False
    for layer in runners[0].model.layers:
        qkv, o_proj, gate_up, down = layer.quantized
        # q / k Q4_K with v Q6_K, gate Q5_K with up Q4_K: each run of one format its own blocks.
        assert isinstance(qkv, MixedQuantizedWeight) and isinstance(gate_up, MixedQuantizedWeight)
        assert [p.format for p in qkv.parts] == ["Q4_K", "Q6_K"]
        assert [p.out_features for p in qkv.parts] == [256 + 128, 128]
        assert [p.format for p in gate_up.parts] == ["Q5_K", "Q4_K"]
        assert (o_proj.format, down.format) == ("Q4_K", "Q6_K")
        if CAN_PREPACK:  # blocks serve steps of few rows, the prepacked copy wider ones: no plain copy
            assert all(w.numel() == 0 for w in layer.plain)
            assert all(w.is_mkldnn for w in layer.onednn)
    # With the plain weights freed nothing but the blocks can serve a step of few rows; count
    # that the mixed ones do, on either path.
    layer_formats, mixed_calls = [], []
    decode_layers, multiply = cpu_ops.few_rows_decode_layers, MixedQuantizedWeight.multiply

    def counted_layers(*args, **kwargs):
        layers = args[1]
        layer_formats.append((layers.formats, layers.parts_per_weight))
        return decode_layers(*args, **kwargs)

    def counted(self: MixedQuantizedWeight, x: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
        mixed_calls.append(x.shape[0])
        return multiply(self, x, int8_activations)

    monkeypatch.setattr(cpu_ops, "few_rows_decode_layers", counted_layers)
    monkeypatch.setattr(MixedQuantizedWeight, "multiply", counted)
    rng = np.random.default_rng(0)
    builders = [PlanBuilder(), PlanBuilder()]
    histories = {i: random_ids(rng, 9 + i, 300) for i in range(4)}
    for runner, builder in zip(runners, builders, strict=True):
        prefill = runner_logits(
            runner, builder, [(i, h, True) for i, h in histories.items()]
        )  # 42 rows: oneDNN
        for row, history in histories.items():
            with torch.inference_mode():
                expected = hf(torch.tensor([history])).logits[0, -1]
            torch.testing.assert_close(prefill[row], expected, atol=1e-4, rtol=1e-4)
    num_layers = len(runners[0].model.layers)
    for num_seqs in (1, 4, 2, 3):  # all-decode steps of few rows: the super-block kernels
        chunks = []
        for i in range(num_seqs):
            histories[i].append(int(rng.integers(0, 300)))
            chunks.append((i, histories[i][-1:], True))
        layer_formats.clear()
        mixed_calls.clear()
        one_op = runner_logits(runners[0], builders[0], chunks)
        # one call for the step: qkv's and gate_up's parts in two formats each, every layer
        formats = ["Q4_K", "Q6_K", "Q4_K", "Q5_K", "Q4_K", "Q6_K"]
        assert layer_formats == [(formats * num_layers, [2, 1, 2, 1] * num_layers)] and not mixed_calls
        layer_formats.clear()
        per_op = runner_logits(runners[1], builders[1], chunks)
        assert (
            mixed_calls == [num_seqs] * 2 * num_layers and not layer_formats
        )  # qkv and gate_up, every layer
        torch.testing.assert_close(one_op, per_op, atol=1e-5, rtol=1e-5)
        for row in range(num_seqs):
            with torch.inference_mode():
                expected = hf(torch.tensor([histories[row]])).logits[0, -1]
            torch.testing.assert_close(one_op[row], expected, atol=1e-4, rtol=1e-4)


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of loader._unpermute), on weights or raw blocks."""
    grouped = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def test_a_q4_k_m_gguf_multiplies_from_its_blocks(
    k_quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture's blocks written as a GGUF file (Q/K rows in llama.cpp's order), converted as a
    worker start converts it: the fused weights mix formats, run from their blocks, and give HF's
    logits on gguf's dequantization of them."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with safe_open(str(k_quant_model / loader.QUANTIZED_FILE), framework="numpy") as f:
        formats = json.loads(f.metadata()["formats"])
        blocks = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    with safe_open(str(k_quant_model / "model.safetensors"), framework="numpy") as f:
        plain = {name: f.get_tensor(name) for name in f.keys() if name not in blocks}  # noqa: SIM118
    config = json.loads((k_quant_model / "config.json").read_text())
    hf_to_gguf = {hf: g for g, hf in loader.GGUF_TO_HF.items()}
    path = tmp_path / "k-quants.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}  # fmt: skip
    for name in sorted({*plain, *blocks}):
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{hf_to_gguf['.'.join(rest[:-1])]}.weight"
        data = blocks[name] if name in blocks else plain[name]
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        projection = name.split(".")[-2]
        if projection in heads:
            data = _permute(data, heads[projection])
        raw = gguf.GGMLQuantizationType[formats[name]] if name in blocks else None
        writer.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    class NoTokenizer:  # this GGUF has no vocabulary; the runner needs none
        def save_pretrained(self, out: str) -> None:
            pass

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *args, **kwargs: NoTokenizer())
    model_dir = loader.prepare_model(str(path), cache_dir=tmp_path / "cache")
    runner = ModelRunner(model_dir, dtype="float32", kv_cache_bytes=4 << 20)
    for layer in runner.model.layers:
        qkv, o_proj, gate_up, down = layer.quantized
        assert isinstance(qkv, MixedQuantizedWeight) and isinstance(gate_up, MixedQuantizedWeight)
        assert o_proj is not None and down is not None
        if CAN_PREPACK:
            assert all(w.numel() == 0 for w in layer.plain)  # only the blocks serve steps of few rows
    hf = AutoModelForCausalLM.from_pretrained(k_quant_model, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    builder = PlanBuilder()
    histories = {i: random_ids(rng, 5 + i, 300) for i in range(2)}
    runner_logits(runner, builder, [(i, h, True) for i, h in histories.items()])
    for _ in range(3):
        chunks = []
        for i in histories:
            histories[i].append(int(rng.integers(0, 300)))
            chunks.append((i, histories[i][-1:], True))
        logits = runner_logits(runner, builder, chunks)
        for row, history in histories.items():
            with torch.inference_mode():
                expected = hf(torch.tensor([history])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
