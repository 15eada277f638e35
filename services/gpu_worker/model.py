"""A compact Llama-family model for serving (Llama 2/3, Mistral, Qwen2 qkv bias, SmolLM2).

Runs flattened variable-length batches that mix prefills and decodes over a paged KV cache. Weights
are plain tensors (merged QKV and gate_up projections), so a layer is a handful of torch calls.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.gpu_worker.attention import Shapes, StepMeta, make_ops


@dataclass
class LlamaConfig:
    """The config.json fields the model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        num_heads = d["num_attention_heads"]
        rope_scaling = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 has qkv biases without saying so in its config.
            attention_bias=d.get("attention_bias", False) or d.get("model_type") == "qwen2",
        )


def rope_cos_sin(config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_pos, D] table: cos of each (position, frequency) in the first half, sin in the second.
    Computed in float32 as HF does, then cast; llama3 frequency scaling applied when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


# On CPUs without native bf16/fp16 matmul (no AVX512-BF16 / AMX), torch's half-precision GEMM runs
# at a fraction of fp32 speed (measured 3.6x slower at 64 rows here). From this many rows on, the
# weights are upcast per call and multiplied in fp32 (the same fp32 accumulation, then rounded back);
# below it the GEMV is bound by reading weights, where half precision's half bytes win.
UPCAST_MIN_ROWS = 4


def has_native_half_matmul(device: torch.device) -> bool:
    if device.type != "cpu":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "amx_bf16" in flags or "avx512_bf16" in flags


class LlamaLayer:
    """One decoder layer's weights."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> None:
        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device)

        h, d = config.hidden_size, config.head_dim
        qkv_size = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
        self.input_norm = empty(h)
        self.qkv = empty(qkv_size, h)
        self.qkv_bias = empty(qkv_size) if config.attention_bias else None
        self.o_proj = empty(h, config.num_attention_heads * d)
        self.post_norm = empty(h)
        self.gate_up = empty(2 * config.intermediate_size, h)
        self.down = empty(h, config.intermediate_size)


class LlamaModel:
    """Owns the weights and runs one step: tokens in, logits of the sampled rows out."""

    def __init__(
        self, config: LlamaConfig, dtype: torch.dtype, device: torch.device, block_size: int
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.embed = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = [LlamaLayer(config, dtype, device) for _ in range(config.num_hidden_layers)]
        self.norm = torch.empty(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if config.tie_word_embeddings else torch.empty_like(self.embed)
        self.shapes = Shapes(
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            block_size,
            rope_cos_sin(config, dtype, device),
        )
        self.ops = make_ops(self.shapes, device, dtype)
        is_half = dtype in (torch.bfloat16, torch.float16)
        self.upcast_min_rows = sys.maxsize
        if is_half and not has_native_half_matmul(device):
            self.upcast_min_rows = UPCAST_MIN_ROWS
        self._loaded: set[str] = set()

    # ---- weights ----------------------------------------------------------------------------------

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF-named weight into its (possibly merged) slot."""
        if name.endswith("rotary_emb.inv_freq"):
            return
        c = self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        if name == "model.embed_tokens.weight":
            dst = self.embed
        elif name == "model.norm.weight":
            dst = self.norm
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                return
            dst = self.lm_head
        else:
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                raise KeyError(f"unexpected weight {name}")
            layer = self.layers[int(parts[2])]
            key = ".".join(parts[3:])
            merged = {
                "self_attn.q_proj.weight": (layer.qkv, 0, q_size),
                "self_attn.k_proj.weight": (layer.qkv, q_size, kv_size),
                "self_attn.v_proj.weight": (layer.qkv, q_size + kv_size, kv_size),
                "mlp.gate_proj.weight": (layer.gate_up, 0, c.intermediate_size),
                "mlp.up_proj.weight": (layer.gate_up, c.intermediate_size, c.intermediate_size),
            }
            if layer.qkv_bias is not None:
                merged["self_attn.q_proj.bias"] = (layer.qkv_bias, 0, q_size)
                merged["self_attn.k_proj.bias"] = (layer.qkv_bias, q_size, kv_size)
                merged["self_attn.v_proj.bias"] = (layer.qkv_bias, q_size + kv_size, kv_size)
            plain = {
                "input_layernorm.weight": layer.input_norm,
                "post_attention_layernorm.weight": layer.post_norm,
                "self_attn.o_proj.weight": layer.o_proj,
                "mlp.down_proj.weight": layer.down,
            }
            if key in merged:
                whole, start, size = merged[key]
                dst = whole.narrow(0, start, size)
            elif key in plain:
                dst = plain[key]
            else:
                raise KeyError(f"unexpected weight {name}")
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self._loaded.add(name)

    def finish_loading(self) -> None:
        """Fail loudly on missing weights (a silently random layer would still 'work')."""
        expected = 3 + 9 * len(self.layers) - (1 if self.config.tie_word_embeddings else 0)
        if self.config.attention_bias:
            expected += 3 * len(self.layers)
        if len(self._loaded) < expected:
            raise ValueError(f"only {len(self._loaded)} of {expected} weights were found")

    # ---- forward ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: StepMeta,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        sample_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """Run all tokens; returns float32 logits [len(sample_tokens), V] of the sampled rows only."""
        ops, eps, scale = self.ops, self.eps, self.scale
        linear = upcast_linear if input_ids.shape[0] >= self.upcast_min_rows else F.linear
        hidden = F.embedding(input_ids, self.embed)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache, strict=True):
            x, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            q, k, v = ops.qkv_rotary(linear(x, layer.qkv, layer.qkv_bias), meta)
            attn = ops.attention(q, k, v, k_cache, v_cache, meta, scale)
            x, residual = ops.rms_norm(linear(attn, layer.o_proj), layer.post_norm, eps, residual)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = linear(F.silu(gate) * up, layer.down)
        # Only the sampled rows go through the final norm and the LM head.
        last = (hidden[sample_tokens] + residual[sample_tokens]).contiguous()
        x, _ = ops.rms_norm(last, self.norm, eps, None)
        if last.shape[0] >= self.upcast_min_rows:
            return F.linear(x.float(), self.lm_head.float())
        return F.linear(x, self.lm_head).float()


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed in fp32 from half-precision operands, rounded back to x's dtype."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)
