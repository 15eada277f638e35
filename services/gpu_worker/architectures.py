"""Which models Brigade runs, read from config.json: a `ModelConfig`, or an `UnsupportedModel`
error that names the feature and lists what is supported.

Everything a family does differently from Llama is a field here, read from the model's own config
wherever it sets one, so the model code branches on features, never on family names. Nothing
here imports torch: the supervisor checks a model with it (loader.prepare_model) before any
stage starts, so a refusal comes before `ready` and the run exits non-zero.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.common.pooling import BASE_MODEL_ARCHITECTURES
from services.common.vision_language import VISION_LANGUAGE, language_model_config

# HF architecture (config.json `architectures`) -> the family whose defaults apply.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# config.json `model_type` of each family, for configs that name no architecture.
MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
    "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe",
    "gpt_oss": "gpt_oss", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
}  # fmt: skip
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")  # "su" is longrope's old name
# HF activation names -> the gate activation the model applies (the MLP is always gated).
# gelu_new and gelu_fast are HF's own spellings of the same tanh approximation; gelu is exact (erf).
ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
}  # fmt: skip
LAYER_TYPES = ("full_attention", "sliding_attention")
# Families whose attention_bias gives q, k, v and o_proj biases (as their HF classes read it).
ALL_PROJECTION_BIAS = ("llama", "qwen3", "gemma2", "gemma3", "qwen3_moe", "olmoe", "gpt_oss")
# Mixture-of-experts families (MoeConfig): their routers softmax over the experts, then take the
# top k; gpt-oss's take the top k of the logits, then softmax over those; DeepSeek's limit the
# choice to the best groups of experts (V3: sigmoid scores with a correction bias).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3")
# Families with multi-head latent attention (MlaConfig).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
# The eps of DeepSeek's q_a and kv_a norms: DeepseekV2/V3RMSNorm's default, not rms_norm_eps.
MLA_NORM_EPS = 1e-6


class UnsupportedModel(ValueError):
    """A model Brigade would run wrongly; raised at load, before any weight is read."""


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP, as the HF MoE families compute it: router logits -> softmax (in
    float32) -> the top `top_k` experts, whose probabilities are renormalized to sum to 1 where
    `norm_topk_prob`; each selected expert is a gated MLP of `intermediate_size`, its output
    weighted by its probability. Qwen2-MoE adds a shared expert that every token runs, scaled by
    sigmoid(shared_expert_gate(x))."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    # Per layer: whether its MLP is the mixture (Qwen's mlp_only_layers / decoder_sparse_step
    # layers are dense, of the config's intermediate_size).
    sparse_layers: tuple[bool, ...] = ()
    # gpt-oss: the router has a bias and takes the top k of its logits, then softmaxes over those k.
    router_bias: bool = False
    softmax_after_topk: bool = False
    # gpt-oss: every expert's gate/up and down projections have biases, and its gated activation
    # is the clamped SwiGLU (gate clamped above and up both sides at swiglu_limit, then
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1)); swiglu_limit 0 = the model's activation.
    expert_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Qwen2-MoE: the shared expert's output is scaled by sigmoid(shared_expert_gate(x)); DeepSeek's
    # shared experts (n_shared_experts of them, one MLP of their summed width) are added as they are.
    shared_expert_gated: bool = True
    # DeepSeek: "sigmoid" scores (V3) instead of the softmax; the experts in `num_groups` equal
    # groups, of which only the `topk_groups` best (each scored by the sum of its `group_score_top`
    # best experts: 1 for V2, 2 for V3) are chosen from; V3 adds a learned correction bias
    # (mlp.gate.e_score_correction_bias) to the scores for choosing only; every weight is then
    # multiplied by routed_scaling_factor.
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score_top: int = 1
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention. q = q_b(norm(q_a(x))) (q_proj(x) without a
    q_lora_rank), each head's qk_nope_head_dim dims then qk_rope_head_dim; kv_a_proj_with_mqa(x)
    gives the latent (kv_lora_rank, normed by kv_a_layernorm) and one rope key shared by all
    heads; kv_b_proj turns the latent into each head's nope key and value (v_head_dim). The KV
    cache holds only the latent and the rotated rope key of each token."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The rope dims as (x0, x1), (x2, x3) pairs (DeepSeek's checkpoints; V2 always), not halves.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Elements cached per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding: theta and its scaling (rope_type one of ROPE_TYPES)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, longrope
    short_factor: tuple[float, ...] = ()  # longrope: up to original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: sequences longer than that
    attention_factor: float = 1.0  # longrope, yarn: cos and sin are scaled by it
    beta_fast: float = 32.0  # yarn: the ramp between interpolated and extrapolated frequencies
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions
    # M-RoPE (Qwen2.5-VL): how many of the rotary frequencies, in order, rotate by a token's
    # temporal, height and width position (services/gpu_worker/attention.py mrope_positions);
    # empty: one position for all.
    mrope_section: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """The config.json fields the model uses, every family difference explicit."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # q, k and v projections have biases (Qwen2, and attention_bias below)
    o_proj_bias: bool = False  # o_proj has one too (attention_bias in Llama, Qwen3 and Gemma; not Qwen2)
    mlp_bias: bool = False  # gate, up and down projections have biases (Llama's mlp_bias)
    activation: str = "silu"  # of the MLP's gate: "silu" or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # norms scale by (1 + w) (Gemma)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2 / 3)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attention_scale: float = 0.0  # the softmax scale; 0 = head_dim ** -0.5
    # Phi-3's partial rotary (partial_rotary_factor): the first rotary_dim dimensions of each q
    # and k head rotate, the rest pass through; 0: the whole head. The loader reorders each head's
    # q and k rows (rotary_order) so that the kernels' whole-head rotation, with frequency 0 for
    # the passing pairs (model.rope_cos_sin), computes it.
    rotary_dim: int = 0
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax; 0 = none
    final_softcap: float = 0.0  # the same on the logits
    fused_weights: bool = False  # qkv_proj and gate_up_proj in the checkpoint (Phi-3)
    # Per layer: its sliding window (0 = attends to the whole context) and its rope (index into ropes).
    layer_windows: tuple[int, ...] = ()
    layer_ropes: tuple[int, ...] = ()
    ropes: tuple[RopeConfig, ...] = ()
    moe: MoeConfig | None = None  # None = every layer's MLP is dense
    # OLMoE: RMSNorm over the whole q and the whole k projection (all heads at once), not per head.
    qk_norm_whole: bool = False
    clip_qkv: float = 0.0  # q, k and v clamped to [-clip, clip] after the norms (OLMoE); 0 = none
    # gpt-oss: a learned logit per query head joins each softmax's denominator (a "sink" that takes
    # attention weight without a value), loaded as self_attn.sinks.
    attention_sinks: bool = False
    mla: MlaConfig | None = None  # DeepSeek's latent attention instead of q/k/v heads

    def kv_cache_width(self, num_kv_heads: int) -> int:
        """Elements one token takes in one layer's KV cache on a rank with `num_kv_heads` KV heads:
        its keys and values, or MLA's latent and rope key (whole on every rank)."""
        return self.mla.cache_width if self.mla is not None else 2 * num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @property
    def long_rope_from(self) -> int:
        """LongRoPE: a sequence longer than this rotates every position with the long factors
        (original_max_position_embeddings); 0 without LongRoPE."""
        return next((r.original_max_position_embeddings for r in self.ropes if r.rope_type == "longrope"), 0)

    @property
    def is_plain_llama(self) -> bool:
        """A Llama layer exactly (what cpu_ops.few_rows_decode_layers computes)."""
        return (
            self.activation == "silu"
            and not (self.qk_norm or self.sandwich_norms or self.attn_softcap)
            and not (self.o_proj_bias or self.mlp_bias)
            and not any(self.layer_windows)
            and len(self.ropes) == 1
            and self.moe is None
            and not (self.qk_norm_whole or self.clip_qkv or self.attention_sinks)
            and self.mla is None
        )

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The config of an HF config.json dict; UnsupportedModel for anything Brigade would run wrongly."""
        d = language_model_config(d)
        architecture, family = _architecture(d)
        _refuse_quantization(d, family)
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        is_gemma = family in ("gemma2", "gemma3")
        has_attention_bias = bool(d.get("attention_bias", family == "gpt_oss"))  # GptOssConfig's default
        activation_name = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if family == "gpt_oss":
            activation_name = "silu"  # GptOssExperts' clamped SwiGLU whatever hidden_act says, as HF
        if activation_name not in ACTIVATIONS:
            raise UnsupportedModel(
                f"unsupported activation {activation_name!r} ({architecture}); supported: {sorted(ACTIVATIONS)}"
            )
        rotary_factor = float(_rope_dict(d).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * rotary_factor)
        # Only Phi-3's HF class rotates part of each head (Phi-4-mini: 0.75); the others' ignore
        # the field, or fail on it.
        if rotary_dim != head_dim and (family != "phi3" or rotary_dim <= 0 or rotary_dim % 2):
            raise UnsupportedModel(
                f"unsupported partial_rotary_factor {rotary_factor:g} ({architecture}): rotary over "
                f"{rotary_dim} of each head's {head_dim} dimensions; supported: 1.0, and for Phi-3 "
                "an even number of dimensions"
            )
        if d.get("use_bidirectional_attention"):
            raise UnsupportedModel(
                "unsupported use_bidirectional_attention; supported: causal attention only"
            )
        layer_types = _layer_types(d, family, num_layers)
        window = int(d.get("sliding_window") or 0)
        if "sliding_attention" in layer_types and window <= 0:
            raise UnsupportedModel("sliding_attention layers without a sliding_window")
        ropes, layer_ropes = _ropes(d, family, layer_types)
        for rope in ropes:
            if rope.mrope_section and sum(rope.mrope_section) != head_dim // 2:
                raise UnsupportedModel(
                    f"unsupported mrope_section {list(rope.mrope_section)}; supported: sections that "
                    f"add up to a head's {head_dim // 2} rotary frequencies"
                )
        if len({r.original_max_position_embeddings for r in ropes if r.rope_type == "longrope"}) > 1:
            raise UnsupportedModel(
                "unsupported LongRoPE ropes with different original lengths; supported: one"
            )
        if family == "qwen2_moe":
            has_attention_bias = bool(d.get("qkv_bias", True))  # q, k and v only (Qwen2MoeAttention)
        attention_scale = 0.0
        if d.get("query_pre_attn_scalar"):
            attention_scale = float(d["query_pre_attn_scalar"]) ** -0.5
        num_kv_heads = d.get("num_key_value_heads") or num_heads
        mla = _mla(d, family)
        if mla is not None:
            # One latent and rope key serve every head (the cache's one "KV head"); the rotary
            # table spans the rope dims; the scale is of the whole q/k head, times YaRN's mscale
            # squared where the config gives mscale_all_dim (as DeepseekV3Attention).
            num_kv_heads, head_dim = 1, mla.qk_rope_head_dim
            attention_scale = mla.qk_head_dim**-0.5 * _mla_mscale(d) ** 2
        return cls(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=d.get("tie_word_embeddings", is_gemma),
            # Qwen2 has qkv biases without saying so in its config; the families whose HF classes
            # read attention_bias put it on all four projections. Mistral and Phi-3 have none.
            attention_bias=family == "qwen2"
            or (family in (*ALL_PROJECTION_BIAS, "qwen2_moe") and has_attention_bias),
            o_proj_bias=family in ALL_PROJECTION_BIAS and has_attention_bias,
            mlp_bias=family == "llama" and bool(d.get("mlp_bias", False)),
            activation=ACTIVATIONS[activation_name],
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            norm_plus_one=is_gemma,
            sandwich_norms=is_gemma,
            embed_scale=hidden**0.5 if is_gemma else 1.0,
            attention_scale=attention_scale,
            # Gemma 3's config keeps Gemma 2's field, but its HF class never applies it: nor do we.
            attn_softcap=float(d.get("attn_logit_softcapping") or 0.0) if family != "gemma3" else 0.0,
            final_softcap=float(d.get("final_logit_softcapping") or 0.0),
            fused_weights=family == "phi3",
            layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
            layer_ropes=layer_ropes,
            ropes=ropes,
            moe=_moe(d, family, num_layers),
            qk_norm_whole=family == "olmoe",
            clip_qkv=float(d.get("clip_qkv") or 0.0) if family == "olmoe" else 0.0,
            attention_sinks=family == "gpt_oss",
            mla=mla,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def _architecture(d: dict) -> tuple[str, str]:
    names = d.get("architectures") or []
    supported = sorted(ARCHITECTURES)
    if not names:
        family = MODEL_TYPES.get(d.get("model_type", ""))
        if family is None:
            raise UnsupportedModel(
                f"config.json names no architecture and model_type {d.get('model_type')!r} is not supported; "
                f"supported architectures: {supported}"
            )
        return next(a for a, f in ARCHITECTURES.items() if f == family), family
    if len(names) == 1 and names[0] in BASE_MODEL_ARCHITECTURES:
        # A family's base model (the causal LM without its head): the same layers, to embed with.
        return names[0], ARCHITECTURES[BASE_MODEL_ARCHITECTURES[names[0]]]
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        supported = sorted([*ARCHITECTURES, *BASE_MODEL_ARCHITECTURES, *VISION_LANGUAGE])
        raise UnsupportedModel(f"unsupported architecture {names}; supported: {supported}")
    return names[0], ARCHITECTURES[names[0]]


def _mla(d: dict, family: str) -> MlaConfig | None:
    """The latent attention of a DeepSeek config (None for the other families)."""
    if family not in MLA_FAMILIES:
        return None
    if d.get("attention_bias"):
        raise UnsupportedModel(
            f"unsupported attention_bias in {family}'s latent attention; supported: no biases (as "
            "DeepSeek's checkpoints)"
        )
    return MlaConfig(
        q_lora_rank=int(d.get("q_lora_rank") or 0),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        # V2 rotates (x0, x1) pairs as complex numbers: the same pairs.
        rope_interleave=family == "deepseek_v2" or bool(d.get("rope_interleave", True)),
    )


def _mla_mscale(d: dict) -> float:
    """YaRN's mscale of the softmax scale, as HF's yarn_apply_mscale: any scaled rope with an
    mscale_all_dim."""
    params = _rope_dict(d)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", params.get("type", "default")) == "default" or not mscale_all_dim:
        return 1.0
    return _yarn_mscale(float(params["factor"]), float(mscale_all_dim))


def _refuse_quantization(d: dict, family: str) -> None:
    quantization = d.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        if method == "mxfp4" and family == "gpt_oss":
            return  # how openai/gpt-oss ships its experts: dequantized at load (loader.dequantize_mxfp4)
        raise UnsupportedModel(
            f"unsupported quantization_config (quant_method {method!r}); supported: unquantized "
            "safetensors (float32, bfloat16, float16), gpt-oss's MXFP4 experts, and GGUF files"
        )


def _rope_dict(d: dict) -> dict:
    """The one rope dict of a config: v5's rope_parameters or the older rope_scaling (+ rope_theta)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "rope_theta" not in params and d.get("rope_theta") is not None:
        params["rope_theta"] = d["rope_theta"]
    return params


def _rope(params: dict, d: dict, default_theta: float = 10000.0) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type
    theta = float(params.get("rope_theta") or default_theta)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"unsupported rope scaling type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    mrope_section = tuple(int(n) for n in params.get("mrope_section") or ())
    if mrope_section and (rope_type != "default" or len(mrope_section) != 3):
        raise UnsupportedModel(
            f"unsupported M-RoPE of rope type {rope_type!r} and mrope_section {list(mrope_section)}; "
            "supported: the default rope type, three sections (temporal, height, width)"
        )
    if rope_type == "default":
        return RopeConfig(theta, mrope_section=mrope_section)
    if rope_type == "dynamic":
        # HF's dynamic NTK scales the base only while a sequence is longer than
        # max_position_embeddings, which no sequence served here is (max_model_len is at most
        # that): up to it, the default rope exactly.
        return RopeConfig(theta)
    if rope_type == "linear":
        return RopeConfig(theta, "linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeConfig(
            theta, "llama3", factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )  # fmt: skip
    if rope_type == "yarn":
        # As HF computes it (modeling_rope_utils._compute_yarn_parameters), where the original
        # length may sit beside rope_parameters (HF copies it in).
        original = int(
            params.get("original_max_position_embeddings")
            or d.get("original_max_position_embeddings")
            or d.get("max_position_embeddings", 2048)
        )
        factor = float(params.get("factor") or d.get("max_position_embeddings", original) / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return RopeConfig(
            theta, "yarn", factor=factor, original_max_position_embeddings=original,
            attention_factor=float(attention_factor), beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)),
        )  # fmt: skip
    # longrope, as HF computes it (modeling_rope_utils._compute_longrope_parameters).
    original = int(d.get("original_max_position_embeddings") or params["original_max_position_embeddings"])
    factor = params.get("factor") or d.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta, "longrope", factor=float(factor), original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]), attention_factor=float(attention_factor),
    )  # fmt: skip


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _ropes(d: dict, family: str, layer_types: list[str]) -> tuple[tuple[RopeConfig, ...], tuple[int, ...]]:
    """The distinct ropes and each layer's. Gemma 3's local layers have their own base (and no
    scaling); v5 configs nest rope_parameters by layer type."""
    params = d.get("rope_parameters") or {}
    if set(params) & set(LAYER_TYPES):
        # HF's _compute_yarn_parameters reads YaRN's `truncate` from the top level of
        # rope_parameters, never a layer type's own dict: a nested truncate is ignored (True).
        by_type = {
            t: _rope({**params[t], "truncate": params.get("truncate", True)}, d)
            for t in LAYER_TYPES
            if t in params
        }
    elif family == "gemma3":
        by_type = {
            "full_attention": _rope(_rope_dict(d), d, default_theta=1_000_000.0),
            "sliding_attention": RopeConfig(float(d.get("rope_local_base_freq", 10000.0))),
        }
    else:
        one = _rope(_rope_dict(d), d)
        by_type = dict.fromkeys(LAYER_TYPES, one)
    ropes: list[RopeConfig] = []
    for t in layer_types:
        if by_type[t] not in ropes:
            ropes.append(by_type[t])
    return tuple(ropes), tuple(ropes.index(by_type[t]) for t in layer_types)


def _layer_types(d: dict, family: str, num_layers: int) -> list[str]:
    """Each layer's attention: "full_attention", or "sliding_attention" over the last sliding_window keys."""
    types = d.get("layer_types")
    if types is None:
        window = d.get("sliding_window")
        if family in ("mistral", "phi3", "mixtral") and window:
            types = ["sliding_attention"] * num_layers
        elif family == "qwen3_moe" and d.get("use_sliding_window") and window:
            types = ["sliding_attention"] * num_layers  # Qwen3MoeAttention: every layer, when set
        elif family == "qwen2_moe" and d.get("use_sliding_window") and window:
            start = d.get("max_window_layers", num_layers)  # Qwen2MoeConfig's own layer_types rule
            types = [
                "sliding_attention" if (i + 1) % 2 and i < start else "full_attention"
                for i in range(num_layers)
            ]
        elif family in ("qwen2", "qwen3") and d.get("use_sliding_window") and window:
            start = d.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
        elif family in ("gemma2", "gpt_oss"):
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        elif family == "gemma3":
            pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        else:
            types = ["full_attention"] * num_layers
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        raise UnsupportedModel(f"unsupported layer_types {unknown or types}; supported: {list(LAYER_TYPES)}")
    return list(types)


# Router settings the MoE families' HF classes do not read; a config that sets one to anything but
# the value below means routing Brigade would not reproduce.
ROUTING_DEFAULTS = {"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1}


def _moe(d: dict, family: str, num_layers: int) -> MoeConfig | None:
    """The mixture-of-experts MLP of a MoE family's config (None for the dense families)."""
    if family not in MOE_FAMILIES:
        return None
    if family in MLA_FAMILIES:
        return _deepseek_moe(d, family, num_layers)
    for key, default in ROUTING_DEFAULTS.items():
        if d.get(key, default) not in (default, None):
            raise UnsupportedModel(
                f"unsupported MoE routing {key}={d[key]!r}; supported: softmax over the experts, then the "
                f"top num_experts_per_tok ({key}={default!r})"
            )
    num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    top_k = int(d.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedModel(
            f"MoE config with num_experts={num_experts} and num_experts_per_tok={top_k}; supported: "
            "1 <= num_experts_per_tok <= num_experts"
        )
    if family == "mixtral":  # one size for every expert; the top-k are always renormalized
        return MoeConfig(num_experts, top_k, int(d["intermediate_size"]), True, 0, (True,) * num_layers)
    if family == "gpt_oss":  # GptOssTopKRouter and GptOssExperts (defaults: GptOssConfig's)
        if float(d.get("swiglu_limit", 7.0)) <= 0:
            # HF clamps at any limit (0: up to 0, the gate below 0); our 0 means no clamp.
            raise UnsupportedModel(
                f"unsupported swiglu_limit={d['swiglu_limit']!r} (gpt_oss); supported: a positive limit"
            )
        return MoeConfig(
            num_experts, top_k, int(d["intermediate_size"]), False, 0, (True,) * num_layers,
            router_bias=True, softmax_after_topk=True, expert_bias=True,
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        )  # fmt: skip
    dense = set(d.get("mlp_only_layers") or ())
    step = int(d.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoeConfig(
        num_experts, top_k, int(d.get("moe_intermediate_size") or d["intermediate_size"]),
        bool(d.get("norm_topk_prob", False)),
        int(d.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
        sparse,
    )  # fmt: skip


# DeepSeek's routing, per family: (scoring_func, the topk_methods it has, the group score's top n).
DEEPSEEK_ROUTING = {
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy"), 1),
    "deepseek_v3": ("sigmoid", ("noaux_tc",), 2),
}


def _deepseek_moe(d: dict, family: str, num_layers: int) -> MoeConfig:
    """DeepSeek-V2 / V3's mixture, as DeepseekV2Moe / DeepseekV3MoE compute it: the first
    first_k_dense_replace layers dense."""
    scoring, methods, group_score_top = DEEPSEEK_ROUTING[family]
    topk_method = d.get("topk_method") or methods[0]
    if (d.get("scoring_func") or scoring) != scoring or topk_method not in methods:
        raise UnsupportedModel(
            f"unsupported MoE routing scoring_func={d.get('scoring_func')!r} topk_method={topk_method!r} "
            f"({family}); supported: scoring_func={scoring!r} with topk_method in {list(methods)}"
        )
    if family == "deepseek_v2" and d.get("norm_topk_prob"):
        # DeepSeek's own code renormalizes then; transformers' DeepseekV2TopkRouter does not.
        raise UnsupportedModel("unsupported norm_topk_prob=True (deepseek_v2); supported: False")
    num_experts, top_k = int(d.get("n_routed_experts") or 0), int(d.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedModel(
            f"MoE config with n_routed_experts={num_experts} and num_experts_per_tok={top_k}; supported: "
            "1 <= num_experts_per_tok <= n_routed_experts"
        )
    grouped = topk_method != "greedy"
    num_groups = int(d.get("n_group") or 1) if grouped else 1
    topk_groups = int(d.get("topk_group") or 1) if grouped else 1
    if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise UnsupportedModel(
            f"MoE config with n_routed_experts={num_experts}, n_group={num_groups}, topk_group={topk_groups}; "
            "supported: n_group divides n_routed_experts, 1 <= topk_group <= n_group"
        )
    expert_size = int(d["moe_intermediate_size"])
    first_dense = int(d.get("first_k_dense_replace") or 0)
    frequency = int(d.get("moe_layer_freq") or 1)
    if frequency != 1:
        # transformers' DeepseekV2/V3DecoderLayer makes every layer from first_k_dense_replace on a
        # mixture, DeepSeek's own code only every moe_layer_freq-th: the two run it differently.
        raise UnsupportedModel(
            f"unsupported moe_layer_freq={frequency} ({family}): transformers ignores it and DeepSeek's own "
            "code does not; supported: 1 (every DeepSeek checkpoint's)"
        )
    return MoeConfig(
        num_experts, top_k, expert_size,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=expert_size * int(d.get("n_shared_experts") or 0),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        shared_expert_gated=False,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_score_top=group_score_top,
        score_correction_bias=family == "deepseek_v3",
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
    )  # fmt: skip


@dataclass(frozen=True)
class BertConfig:
    """An encoder-only BERT (`BertModel`, services/gpu_worker/bert.py): what its forward reads.
    Only what runs as HF runs it is accepted: absolute positions, exact GELU, one rank."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        if d.get("architectures") != ["BertModel"]:
            raise UnsupportedModel(f"not an encoder-only BertModel: {d.get('architectures')}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel(
                f"unsupported BERT position_embedding_type {d['position_embedding_type']!r}; supported: absolute"
            )
        if d.get("hidden_act", "gelu") != "gelu":
            raise UnsupportedModel(f"unsupported BERT hidden_act {d['hidden_act']!r}; supported: gelu")
        if d.get("is_decoder"):
            raise UnsupportedModel("unsupported BERT is_decoder (causal BERT); supported: the encoder")
        if d["hidden_size"] % d["num_attention_heads"]:
            raise UnsupportedModel("BERT hidden_size is not a multiple of num_attention_heads")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            max_position_embeddings=d.get("max_position_embeddings", 512),
            type_vocab_size=d.get("type_vocab_size", 2),
            layer_norm_eps=d.get("layer_norm_eps", 1e-12),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))


def config_from_dir(model_dir: Path) -> ModelConfig | BertConfig:
    """The model's config, decoder or encoder; UnsupportedModel for what Brigade would run wrongly."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("architectures") == ["BertModel"]:
        return BertConfig.from_dict(raw)
    return ModelConfig.from_dict(raw)


def check_draft_model(target: ModelConfig | BertConfig, draft_dir: Path) -> ModelConfig:
    """The draft model's config (speculative.method draft_model, docs/speculative.md), or
    UnsupportedModel saying why it cannot propose for `target`: no model there, a model Brigade
    does not run, an encoder, a vocabulary of another size than the target's (its token ids
    would mean other tokens), or a target that never speculates (a sliding window on every layer,
    or LongRoPE: their blocks and rotary regime assume one new token per decode)."""
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").is_file():
        raise UnsupportedModel(f"speculative.model: {draft_dir} is not a model directory (no config.json)")
    if isinstance(target, BertConfig):
        raise UnsupportedModel(
            "speculative.method draft_model: the target is an encoder; it generates nothing"
        )
    if target.layer_windows and min(target.layer_windows) > 0:
        raise UnsupportedModel(
            f"speculative.method draft_model: the target has a sliding window ({max(target.layer_windows)} "
            "tokens) on every layer, and such models do not speculate"
        )
    if target.long_rope_from:
        raise UnsupportedModel(
            "speculative.method draft_model: the target uses LongRoPE, and such models do not speculate"
        )
    draft = config_from_dir(draft_dir)
    if isinstance(draft, BertConfig):
        raise UnsupportedModel(f"speculative.model: {draft_dir} is an encoder, not a model that generates")
    if draft.architecture in BASE_MODEL_ARCHITECTURES:
        raise UnsupportedModel(
            f"speculative.model: {draft_dir} is a base model ({draft.architecture}) with no LM head, not a "
            "model that generates"
        )
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedModel(
            f"speculative.model: the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}: a draft must share the target's tokenizer and vocabulary"
        )
    return draft
