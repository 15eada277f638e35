"""GGUF conversion against transformers' own GGUF loading, the conversion cache, and weight loading."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.gpu_worker import loader
from services.gpu_worker.architectures import ModelConfig
from services.gpu_worker.loader import default_model_path, load_weights, prepare_model
from services.gpu_worker.model import LlamaModel


@pytest.mark.slow
def test_gguf_conversion_matches_transformers(smollm2_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF path (from_pretrained(gguf_file=) minus its accelerate requirement).
    gguf = Path(default_model_path())
    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    expected = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)["tensors"]
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    # Tied embeddings: HF lists lm_head.weight as an alias of the embedding; we store it once.
    assert set(expected) - set(ours) <= {"lm_head.weight"}
    assert set(ours) <= set(expected)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0, msg=name)
    config = json.loads((smollm2_dir / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == pytest.approx(hf_config.rope_parameters["rope_theta"])
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).exists(), name


def test_gguf_blocks_are_the_converted_weights(smollm2_dir: Path):
    """quantized.safetensors keeps every Q4_1 / Q8_0 weight as its GGUF blocks, rows in HF order
    (Q and K unpermuted like the float32 copy): dequantized, each is exactly that copy."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors import safe_open

    ours = load_file(str(smollm2_dir / "model.safetensors"))
    with safe_open(str(smollm2_dir / loader.QUANTIZED_FILE), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        assert len(formats) == 211 and set(formats.values()) == {"Q4_1", "Q8_0"}  # 30 layers x 7, embedding
        assert set(formats) <= set(ours)
        for name in ("model.embed_tokens.weight", *(f"model.layers.{i}.{w}.weight" for i in (0, 29) for w in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))):  # fmt: skip
            blocks = f.get_tensor(name).numpy()
            weight = dequantize(blocks, GGMLQuantizationType[formats[name]]).astype("float32")
            torch.testing.assert_close(torch.from_numpy(weight), ours[name], atol=0, rtol=0, msg=name)


def test_cache_hit_is_fast_and_hf_dirs_pass_through(smollm2_dir: Path):
    start = time.perf_counter()
    assert prepare_model(None) == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert prepare_model(str(smollm2_dir)) == smollm2_dir


def test_crash_mid_convert_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path):
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
