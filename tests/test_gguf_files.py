"""GGUF files as llama.cpp's converter writes them. Rope scaling: Llama 3.1+ records its llama3 scaling only as the rope_freqs.weight
tensor (llama.cpp's converter), and a GGUF may say `rope.scaling.type linear`. Both convert into a
config that gives HF's logits; any other scaling is refused by name (tests/test_refusals.py).

The rope_freqs values are computed here as llama.cpp's convert_hf_to_gguf.py computes them (in
float32 torch), independently of the loader's search for the matching parameters."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker import loader
from services.gpu_worker.architectures import ModelConfig, UnsupportedModel
from services.gpu_worker.model_runner import ModelRunner
from tests.test_model import PlanBuilder, random_ids, runner_logits

pytestmark = pytest.mark.timeout(300)

VOCAB = 300


def llama_cpp_rope_freqs(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_factors for a llama3 rope_scaling (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


@pytest.mark.parametrize(
    ("factor", "low", "high", "original", "theta", "head_dim"),
    [
        (8.0, 1.0, 4.0, 8192, 500000.0, 128),  # Llama 3.1 / 3.3
        (32.0, 1.0, 4.0, 8192, 500000.0, 64),  # Llama 3.2 1B
        (32.0, 1.0, 4.0, 8192, 500000.0, 128),  # Llama 3.2 3B
        (4.0, 1.0, 4.0, 64, 10000.0, 16),  # the small model below
    ],
)
def test_rope_freqs_give_back_llama3_parameters(
    factor: float, low: float, high: float, original: int, theta: float, head_dim: int
) -> None:
    scaling = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high}
    scaling["original_max_position_embeddings"] = original
    divisors = llama_cpp_rope_freqs(scaling, theta, head_dim).astype(np.float64)
    found = loader._llama3_scaling(divisors, head_dim, theta, None)
    assert found == {"rope_type": "llama3", **scaling}


def test_rope_freqs_that_are_not_llama3_are_refused() -> None:
    assert loader._llama3_scaling(np.ones(8), 16, 10000.0, None) is None
    with pytest.raises(UnsupportedModel, match=r"rope_freqs\.weight is not llama3 rope scaling"):
        loader._llama3_scaling(np.linspace(1.0, 3.0, 8), 16, 10000.0, None)
    with pytest.raises(UnsupportedModel, match="has 4 values, expected 8"):
        loader._llama3_scaling(np.ones(4), 16, 10000.0, None)


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of loader._unpermute)."""
    grouped = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def write_gguf(hf_dir: Path, path: Path, scaling: dict | None = None, arch: str = "llama") -> Path:
    """A float32 GGUF of an HF Llama, Qwen2 or Qwen3 dir, named and ordered as llama.cpp's
    converter writes it: Q and K rows permuted for llama only (Qwen's keep HF's order), llama3
    scaling as rope_freqs.weight, linear scaling as rope.scaling.* keys."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    theta = config.rope_parameters["rope_theta"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if scaling is not None and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if scaling is not None and scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(scaling, theta, head_dim))
    to_gguf = {hf: g for g, hf in loader.GGUF_TO_HF.items()}
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}  # fmt: skip
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, data in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, *rest = name.split(".")
            gguf_name = f"blk.{layer}.{to_gguf['.'.join(rest[:-1])]}.{rest[-1]}"
        projection = name.split(".")[-2]
        if projection in heads and arch == "llama":
            data = _permute(data, heads[projection])
        writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
    ],
    ids=["llama3", "linear"],
)  # fmt: skip
def test_a_scaled_llama_gguf_gives_hfs_logits(
    scaling: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random Llama whose rotary dimensions fall in all three llama3 bands (head_dim 16, theta
    1e4, original context 64), through its GGUF, against HF on the original weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={**scaling, "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    path = write_gguf(hf_dir, tmp_path / "scaled.gguf", scaling)
    runner = gguf_runner(path, tmp_path, monkeypatch)
    assert runner.model.config.ropes[0].rope_type == scaling["rope_type"]
    check_against_hf(runner, AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())


def gguf_runner(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """A runner on the GGUF, converted as a worker start converts it."""

    class NoTokenizer:  # these GGUFs have no vocabulary; the runner needs none
        def save_pretrained(self, out: str) -> None:
            pass

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *args, **kwargs: NoTokenizer())
    model_dir = loader.prepare_model(str(path), cache_dir=tmp_path / "cache")
    return ModelRunner(model_dir, dtype="float32", kv_cache_bytes=4 << 20)


def check_against_hf(runner: ModelRunner, hf, prompt_len: int = 90) -> None:
    """A prefill (by default past the original context of the scaled models: every rope band
    matters) and three decodes, logits against HF's full forward."""
    rng = np.random.default_rng(3)
    history = random_ids(rng, prompt_len, VOCAB)
    builder = PlanBuilder()
    logits = runner_logits(runner, builder, [(0, history, True)])
    for _ in range(3):
        with torch.inference_mode():
            expected = hf(torch.tensor([history])).logits[0, -1]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
        history.append(int(expected.argmax()))
        logits = runner_logits(runner, builder, [(0, history[-1:], True)])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_qwen_gguf_gives_hfs_logits(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp writes Qwen's Q and K rows in HF's order (its rope is the NeoX one): the loader
    must not reorder them as it does a llama GGUF's. Qwen2 with its q/k/v biases; Qwen3 with q/k
    norms, tied embeddings and a head_dim that is not hidden / heads (key_length in the file)."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    else:
        config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)  # HF's init makes them 0 and 1
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{family}.gguf", arch=family)
    runner = gguf_runner(path, tmp_path, monkeypatch)
    parsed = runner.model.config
    assert (parsed.architecture, parsed.head_dim) == (type(model).__name__, 32 if family == "qwen3" else 16)
    check_against_hf(
        runner, AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    )


# HF -> llama.cpp names of Phi-3's tensors (its converter's tensor map), written out here
# independently of the loader's map.
PHI3_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def test_a_phi3_longrope_gguf_gives_hfs_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 as llama.cpp writes it: fused attn_qkv and ffn_up (gate and up) in HF's order, its
    longrope factors as rope_factors_long / short tensors, the original context and the
    attention factor as metadata. The converted config's ropes equal the HF checkpoint's exactly
    (short and long factors, the original length, the attention factor), and the logits are HF's
    within the original length (past it, the scheduler picks the regime: tests/test_longrope.py)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM

    rng = np.random.default_rng(4)
    # float32 values, as the GGUF stores them, so that the converted factors equal these exactly
    long = (1.0 + rng.random(8) * 3).astype(np.float32).tolist()
    short = (1.0 + rng.random(8)).astype(np.float32).tolist()
    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": long, "short_factor": short},
    )  # fmt: skip
    torch.manual_seed(2)
    Phi3ForCausalLM(config).save_pretrained(tmp_path / "hf")
    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(256)
    writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(0)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(256 / 64) / math.log(64)))  # as its converter
    writer.add_tensor("rope_factors_long.weight", np.array(long, np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(short, np.float32))
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}  # fmt: skip
    for name, data in sorted(load_file(str(tmp_path / "hf" / "model.safetensors")).items()):
        if name in top:
            writer.add_tensor(top[name], data)
        else:
            _, _, layer, *rest = name.split(".")
            writer.add_tensor(f"blk.{layer}.{PHI3_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    runner = gguf_runner(path, tmp_path, monkeypatch)
    (ours,), (theirs,) = runner.model.config.ropes, ModelConfig.from_dir(tmp_path / "hf").ropes
    assert ours.rope_type == "longrope"
    assert replace(ours, attention_factor=1.0) == replace(theirs, attention_factor=1.0)
    assert ours.attention_factor == pytest.approx(theirs.attention_factor, rel=1e-6)  # float32 in the file
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    check_against_hf(runner, hf, prompt_len=40)


def test_a_phi3_gguf_with_partial_rotary_is_refused(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "partial.gguf"), "phi3")
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_rope_dimension_count(8)  # half of each 16-dimension head
    writer.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="rope over 8 of each head's 16 dimensions"):
        loader.check_gguf(gguf.GGUFReader(str(tmp_path / "partial.gguf")))


# HF -> llama.cpp names of Gemma's layer tensors (its converters' tensor map).
GEMMA_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_gguf_gives_hfs_logits(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2 / 3 as llama.cpp writes them: every norm stored as (1 + w), no LM head (tied), the
    window (and Gemma 2's soft caps, Gemma 3's global rope base and linear scaling) as metadata,
    no attention scale (llama.cpp's rule: head_dim below 27B). A prompt longer than the window:
    the sliding layers (every other one in Gemma 2, five in six in Gemma 3) matter."""
    import gguf
    import transformers
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=256, sliding_window=24, pad_token_id=0,
    )  # fmt: skip
    if family == "gemma2":
        config = transformers.Gemma2Config(
            **common, num_hidden_layers=2, attn_logit_softcapping=20.0, final_logit_softcapping=10.0
        )
    else:
        config = transformers.Gemma3TextConfig(
            **common, num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)  # norms away from 0: (1 + w) matters
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{family}.gguf"
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_sliding_window(24)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(20.0)
        writer.add_final_logit_softcapping(10.0)
    else:
        writer.add_rope_freq_base(1e6)  # the global layers'
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for name, data in sorted(load_file(str(tmp_path / "hf" / "model.safetensors")).items()):
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # as llama.cpp's Gemma converters
        if name in top:
            writer.add_tensor(top[name], data)
        elif name != "lm_head.weight":
            _, _, layer, *rest = name.split(".")
            writer.add_tensor(f"blk.{layer}.{GEMMA_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    runner = gguf_runner(path, tmp_path, monkeypatch)
    parsed, want = runner.model.config, ModelConfig.from_dir(tmp_path / "hf")
    assert parsed.architecture == want.architecture and parsed.tie_word_embeddings
    fields = ("attn_softcap", "final_softcap", "layer_windows", "layer_ropes", "ropes", "attention_scale")
    assert [getattr(parsed, f) for f in fields] == [getattr(want, f) for f in fields]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    check_against_hf(runner, hf, prompt_len=40)
