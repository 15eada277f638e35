"""GGUF conversion against transformers' own GGUF loading, the conversion cache, and weight loading."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.gpu_worker import loader
from services.gpu_worker.architectures import ModelConfig
from services.gpu_worker.loader import load_weights, prepare_model
from services.gpu_worker.model import LlamaModel


@pytest.mark.slow
def test_gguf_conversion_matches_transformers(smollm2_dir: Path, gguf_reference_weights: dict):
    """The weights a worker loads from the converted dir are exactly transformers' dequantization
    of the GGUF; the config agrees with transformers' reading of it."""
    expected = gguf_reference_weights["tensors"]
    ours = dict(loader.iter_weights(smollm2_dir))
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    hf_config = gguf_reference_weights["config"]
    config = json.loads((smollm2_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == pytest.approx(hf_config.rope_parameters["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).exists(), name


def test_the_cache_keeps_blocks_and_bfloat16_not_float32(smollm2_dir: Path, gguf_reference_weights: dict):
    """quantized.safetensors keeps every quantized weight as its GGUF blocks (rows in HF order);
    model.safetensors holds the GGUF's F32 tensors (the norms) as they are and only a bfloat16
    rounding of the quantized ones, for HF: the cache is 353 MB instead of 609 MB in float32."""
    from safetensors import safe_open

    expected = gguf_reference_weights["tensors"]
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    with safe_open(str(smollm2_dir / loader.QUANTIZED_FILE), framework="numpy") as f:
        formats = json.loads(f.metadata()["formats"])
        assert len(formats) == 211 and set(formats.values()) == {"Q4_1", "Q8_0"}  # 30 layers x 7, embedding
        for name in formats:
            dequantized = torch.from_numpy(loader.dequantize_blocks(f.get_tensor(name), formats[name]))
            torch.testing.assert_close(dequantized, expected[name], atol=0, rtol=0, msg=name)
    for name, tensor in ours.items():
        if name in formats:
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
        else:
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    weights_bytes = sum(p.stat().st_size for p in smollm2_dir.glob("*.safetensors"))
    float32_bytes = 4 * sum(t.numel() for t in expected.values())
    assert weights_bytes < 0.7 * float32_bytes


def test_cache_hit_is_fast_and_hf_dirs_pass_through(smollm2_dir: Path):
    start = time.perf_counter()
    assert prepare_model(None) == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert prepare_model(str(smollm2_dir)) == smollm2_dir


def test_crash_mid_convert_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
):
    def crash(gguf_path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-convert")

    monkeypatch.setattr(loader, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="mid-convert"):
        prepare_model(None, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []

    config = (tiny_model_dir / "config.json").read_text()

    def complete(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text(config)

    monkeypatch.setattr(loader, "convert_gguf", complete)
    out = prepare_model(None, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == [out.name]
    assert (out / "config.json").read_text() == config


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hf.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config = ModelConfig.from_dict(json.loads((tiny_model_dir / "config.json").read_text()))
    single = LlamaModel(config, torch.float32, torch.device("cpu"), 16)
    sharded = LlamaModel(config, torch.float32, torch.device("cpu"), 16)
    load_weights(single, tiny_model_dir)
    load_weights(sharded, tmp_path)
    for a, b in zip(single.layers, sharded.layers, strict=True):
        torch.testing.assert_close(a.qkv, b.qkv, atol=0, rtol=0)
        torch.testing.assert_close(a.gate_up, b.gate_up, atol=0, rtol=0)
    torch.testing.assert_close(single.embed, sharded.embed, atol=0, rtol=0)
    q_size = config.num_attention_heads * config.head_dim
    torch.testing.assert_close(single.layers[0].qkv[:q_size], hf.model.layers[0].self_attn.q_proj.weight.data)


def test_untied_head_and_qkv_bias_are_loaded(tmp_path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    model = LlamaModel(config, torch.float32, torch.device("cpu"), 16)
    load_weights(model, tmp_path)
    assert model.lm_head is not model.embed
    torch.testing.assert_close(model.lm_head, hf.lm_head.weight.data)
    torch.testing.assert_close(model.layers[0].qkv_bias[:64], hf.model.layers[0].self_attn.q_proj.bias.data)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_dequantize_blocks_is_ggufs_bit_for_bit(fmt: str):
    """The loader's whole-weight dequantization of the formats it does itself equals gguf's own,
    bit for bit, on random blocks: every scale a float16 of any kind (subnormal, inf, NaN too)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[fmt]
    rows = np.random.default_rng(7).integers(0, 256, (9, 5 * GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        got, want = loader.dequantize_blocks(rows, fmt), dequantize(rows, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape == (9, 5 * 32)
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
