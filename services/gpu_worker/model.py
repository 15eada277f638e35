"""A compact decoder for the Llama-style families of architectures.py (Llama 2/3, Mistral,
Qwen2/2.5/3, Gemma 2/3, Phi-3, SmolLM2).

Runs flattened variable-length batches that mix prefills and decodes over a paged KV cache. Weights
are plain tensors (merged QKV and gate_up projections), so a layer is a handful of torch calls;
what a family does differently is a ModelConfig field (q/k norms, sandwich norms, GeGLU, soft
caps, sliding windows, per-layer ropes), never a branch on its name.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from services.gpu_worker.architectures import ModelConfig, MoeConfig, RopeConfig
from services.gpu_worker.attention import Shapes, StepMeta, TorchOps, TritonOps, make_ops
from services.gpu_worker.huge_pages import huge_page_empty, huge_page_zeros
from services.gpu_worker.mla import MlaOps, MlaWeights, mla_attention
from services.gpu_worker.parallel import Parallel

log = logging.getLogger(__name__)


def rope_cos_sin(
    rope: RopeConfig,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    rotary_dim: int = 0,
) -> torch.Tensor:
    """[max_pos, D] table: cos of each (position, frequency) in the first half, sin in the second.
    LongRoPE's is [2 * max_pos, D]: the short factors' rows, then the long factors' (a token of a
    sequence in the long regime rotates by row max_pos + position: attention.rotary_rows).
    Computed in float32 as HF does (modeling_rope_utils), then cast. With a partial rotary
    (rotary_dim < D) the frequencies are those of rotary_dim dimensions, then frequency 0 (cos 1,
    sin 0) for the pairs that pass through (the heads' rows are in rotary_order)."""
    dim = rotary_dim or head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freqs = [1.0 / (rope.theta**exponent)]
    if rope.rope_type == "linear":
        inv_freqs = [inv_freqs[0] / rope.factor]
    elif rope.rope_type == "llama3":
        inv_freq = inv_freqs[0]
        factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
        old_len = rope.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freqs = [torch.where(is_medium, smoothed, scaled)]
    elif rope.rope_type == "yarn":
        inv_freqs = [yarn_inv_freq(rope, dim)]
    elif rope.rope_type == "longrope":
        inv_freqs = [
            1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponent)
            for factors in (rope.short_factor, rope.long_factor)
        ]
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.cat([torch.outer(positions, inv_freq) for inv_freq in inv_freqs])
    cos, sin = freqs.cos() * rope.attention_factor, freqs.sin() * rope.attention_factor
    passing = (head_dim - dim) // 2
    if passing:
        cos = torch.cat((cos, cos.new_ones(len(cos), passing)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(len(sin), passing)), dim=-1)
    return torch.cat((cos, sin), dim=-1).to(dtype=dtype, device=device)


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dimensions that makes HF's partial rotary (pairs (i, i + R/2) of the
    first R dimensions rotate, the rest pass) a whole-head one (pairs (j, j + D/2)): position j
    takes dimension order[j]. q and k heads reordered alike keep every q . k, so attention sees
    the same scores; the passing dimensions fill the pairs past R/2, whose frequency is 0."""
    half, rotary_half = head_dim // 2, rotary_dim // 2
    passing = torch.arange(rotary_dim, head_dim)
    return torch.cat(
        (
            torch.arange(rotary_half),
            passing[: half - rotary_half],
            torch.arange(rotary_half, rotary_dim),
            passing[half - rotary_half :],
        )
    )


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's frequencies, as HF's _compute_yarn_parameters: the original ones (extrapolation)
    for the dimensions that rotate more than beta_fast times over the original length, those
    divided by `factor` (interpolation) for the ones that rotate fewer than beta_slow times, and a
    linear ramp between the two."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


# On CPUs without native bf16/fp16 matmul (no AVX512-BF16 / AMX), torch's half-precision GEMM runs
# at a fraction of fp32 speed (docs/performance.md). From this many rows on, the weights are upcast
# per call and multiplied in fp32 (the same fp32 accumulation, then rounded back); below it the GEMV
# is bound by reading weights, where half precision's half bytes win.
UPCAST_MIN_ROWS = 4

# float32 on the CPU, steps of up to cpu_ops.MAX_LINEAR_ROWS rows: the C++ few-rows linear reads
# each [out, in] weight row once for all the rows, on every thread: such a step is bound by
# reading weights, which torch's GEMV and F.linear do less well (docs/performance.md has the step
# times). Without the kernel (no compiler) up to this many rows multiply by [in, out] weight
# copies (W^T, row-major), which torch's GEMV reads much faster than the [out, in] ones F.linear
# takes; that fallback keeps a third copy of the weights (540 MB more for SmolLM2).
TRANSPOSED_MAX_ROWS = 3

# float32 on the CPU, from TRANSPOSED_MAX_ROWS + 1 rows on: oneDNN multiplies (torch's MKL sgemm is
# slower on these steps; docs/performance.md), except where INT8_BLOCKS_MAX_ROWS says otherwise.
# It reads one float32 copy of each weight: the plain [out, in] one that the few-rows kernel also
# reads, or, where the few-rows path reads GGUF blocks instead, the weight reordered once into
# oneDNN's blocked layout (oneDNN's weight prepacking, which inductor also uses) and the plain one
# freed. Prepacking every weight would keep two float32 copies for a mere 1.0-1.3x on wide steps.
CAN_PREPACK = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)

# engine.cpu_int8_activations, with the few-rows kernels: steps of cpu_ops.MAX_LINEAR_ROWS + 1 up to
# this many rows multiply the weights that have GGUF blocks against 8-bit activations
# (cpu_ops.linear_quantized_int8) instead of their oneDNN float32 copy; wider steps keep oneDNN,
# whose float32 GEMM is as fast there and faster at 64 rows (docs/performance.md, "8-bit activations").
# Per build of the kernels (cpu_ops.isa()): on an AVX-512 CPU oneDNN's GEMM is AVX-512 too, and
# faster than the 8-bit kernel from 5 rows on, so there the option stops at the few-rows steps.
INT8_BLOCKS_MAX_ROWS = {"avx2": 32, "avx512": cpu_ops.MAX_LINEAR_ROWS}


class ProjectionDeltas(Protocol):
    """What a step adds to some tokens' projections beyond the base weights (LoRA adapters:
    services/gpu_worker/lora.py's LoraBatch)."""

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """out += the deltas of layer `layer`'s `modules` (HF names, in out's column order) on x."""

    def decode_arguments(self) -> tuple:
        """Every layer's deltas as cpu_ops.few_rows_decode_layers takes them (its `lora`)."""


# engine.cpu_wide_step_dtype=bfloat16: in float32 on the CPU, steps of more than
# cpu_ops.MAX_LINEAR_ROWS rows (prefills, batched decodes) multiply oneDNN-prepacked bfloat16
# copies of the layers' weights by their activations rounded to bfloat16 (float32 accumulation,
# the outputs rounded to bfloat16 and widened back), with the CPU's bf16 dot products
# (vdpbf16ps, or AMX): about 1.8x float32's GEMM rate on a Zen 5 core (docs/performance.md,
# "bf16 wide steps"). Where a weight has GGUF blocks (read by steps of few rows) the bf16 copy
# replaces its float32 oneDNN copy, so it halves that memory instead of adding to it. The LM head
# of a step that samples more rows is such a copy too (steps of few rows keep the float32 head or
# its GGUF blocks): its logits are rounded to bfloat16, as vLLM's bf16 models' are.
WIDE_STEP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def has_native_half_matmul(device: torch.device) -> bool:
    """Whether this device multiplies half precision natively: any GPU, a CPU with AVX-512 BF16 or
    AMX (cpu_ops.cpu_flags)."""
    if device.type != "cpu":
        return True
    return bool({"amx_bf16", "avx512_bf16"} & cpu_ops.cpu_flags())


@dataclass(frozen=True)
class ImageRows:
    """A step's image tokens (indices in the flat batch) and their embeddings [len(tokens), hidden]
    from the encoder stage (services/encoder/)."""

    tokens: torch.Tensor
    embeddings: torch.Tensor


@dataclass(frozen=True)
class Shard:
    """The slices of the full model one tensor-parallel rank holds (all of it with one rank):
    its query and KV heads, its columns of the MLP, and its rows of the vocabulary."""

    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    intermediate_start: int
    intermediate_size: int
    vocab_start: int
    num_vocab_rows: int  # rows of this rank's embedding that hold real tokens
    vocab_shard_size: int  # rows of every rank's embedding (the last one is padded with zeros)
    # MoE: this rank's columns of every expert's MLP, and of the shared expert's (0 without one).
    expert_intermediate_start: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_start: int = 0
    shared_intermediate_size: int = 0
    # MoE: the experts this rank holds (every one, but with expert parallelism).
    expert_start: int = 0
    num_local_experts: int = 0

    @classmethod
    def of(cls, config: ModelConfig, parallel: Parallel) -> Shard:
        rank, world = parallel.rank, parallel.world_size
        num_kv = config.num_key_value_heads
        group = config.num_attention_heads // num_kv
        if num_kv >= world:
            # Whole KV groups (a KV head and its query heads) per rank; when they do not divide
            # evenly (SmolLM2's 3 over 2 ranks) the first ranks take one group more.
            kv_head_start, num_kv_heads = parallel.split_uneven(num_kv)
            head_start, num_heads = kv_head_start * group, num_kv_heads * group
        elif world % num_kv == 0:
            # More ranks than KV heads: each KV head is replicated on world / num_kv ranks, whose
            # query heads all belong to it.
            head_start, num_heads = parallel.split(config.num_attention_heads, "num_attention_heads")
            kv_head_start, num_kv_heads = rank // (world // num_kv), 1
        else:
            raise ValueError(
                f"tensor_parallel ({world}) must be <= or a multiple of num_key_value_heads ({num_kv})"
            )
        if config.qk_norm_whole and world > num_kv:
            # Its k norm spans all KV heads: a replicated KV head would count twice in the sum of
            # squares the ranks add up (norm_whole_qk).
            raise ValueError(
                f"{config.architecture}: its q/k norms span all heads (OLMoE), so tensor_parallel "
                f"({world}) must not exceed num_key_value_heads ({num_kv})"
            )
        inter_start, inter_size = parallel.split(config.intermediate_size, "intermediate_size")
        # Each expert's intermediate dimension is split like a dense MLP's: every rank routes the
        # same way and holds a column slice of every expert, so one all_reduce sums the mixture.
        # With expert parallelism a rank holds num_experts / world whole experts instead, and its
        # partial sum is its experts' share of each token's mixture: the same all_reduce sums it.
        # (Every rank holds every token, so that all_reduce is the tokens' exchange.)
        moe = config.moe or MoeConfig(0, 0, 0, False)
        if parallel.expert_parallel and moe.num_experts:
            expert_split = (0, moe.intermediate_size)
            experts = parallel.split(moe.num_experts, "num_experts")
        else:
            expert_split = parallel.split(moe.intermediate_size, "moe_intermediate_size")
            experts = (0, moe.num_experts)
        shared_split = parallel.split(moe.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        vocab_shard = -(-config.vocab_size // world)
        vocab_start = rank * vocab_shard
        num_vocab_rows = max(min(vocab_shard, config.vocab_size - vocab_start), 0)
        return cls(
            head_start, num_heads, kv_head_start, num_kv_heads,
            inter_start, inter_size, vocab_start, num_vocab_rows, vocab_shard, *expert_split, *shared_split,
            *experts,
        )  # fmt: skip


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as GGUF blocks, in the order cpu_ops.few_rows_linear_quantized reads them."""

    blocks: torch.Tensor  # [out, in / block weights * block bytes] uint8
    format: str  # one of cpu_ops.QUANTIZED_FORMATS

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def multiply(self, x: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
        """x @ W^T: for x of at most cpu_ops.MAX_LINEAR_ROWS rows, or of any number with x
        quantized to 8 bits first (int8_activations: cpu_ops.linear_quantized_int8)."""
        if int8_activations:
            return cpu_ops.linear_quantized_int8(x, self.blocks, self.format)
        return cpu_ops.few_rows_linear_quantized(x, self.blocks, self.format)


@dataclass(frozen=True)
class MixedQuantizedWeight:
    """A fused weight whose parts are blocks of different formats (a Q4_K_M file's Q4_K q / k
    with Q6_K v): each run of rows of one format multiplies into its own columns of the output
    (here, and in cpu_ops.few_rows_decode_layers, which takes a weight as its parts)."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def multiply(self, x: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
        return torch.cat([part.multiply(x, int8_activations) for part in self.parts], dim=-1)


Blocks = QuantizedWeight | MixedQuantizedWeight


def blocks_of(parts: list[torch.Tensor], formats: list[str]) -> Blocks | None:
    """The weight made of these HF weights' blocks stacked by rows; None where a format is not one
    the kernels read."""
    if any(fmt not in cpu_ops.QUANTIZED_FORMATS for fmt in formats):
        return None
    runs: list[tuple[str, list[torch.Tensor]]] = []
    for part, fmt in zip(parts, formats, strict=True):
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(part)
        else:
            runs.append((fmt, [part]))
    weights = [
        QuantizedWeight(torch.from_numpy(cpu_ops.to_lanes(torch.cat(p).numpy(), fmt)), fmt) for fmt, p in runs
    ]
    return weights[0] if len(weights) == 1 else MixedQuantizedWeight(tuple(weights))


@dataclass(frozen=True)
class QuantizedExperts:
    """A sparse layer's experts kept as their GGUF blocks, or gpt-oss's as their MXFP4 blocks (no
    float32 copy): gate and up [experts, I, bytes], down [experts, H, bytes], uint8, each expert's
    rows packed by cpu_ops.to_lanes, one format a projection (a GGUF stores each projection of all
    experts as one tensor). Steps of up to cpu_ops.MOE_MAX_ROWS rows multiply the selected experts
    from them in one op; wider ones dequantize each selected expert for the GEMM (`dequantized`)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    formats: tuple[str, str, str]  # gate's, up's, down's

    @classmethod
    def of(cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor],
           formats: tuple[str, str, str]) -> QuantizedExperts:  # fmt: skip
        """From each expert's GGUF blocks [rows, bytes] (the file's, unpacked), in expert order."""

        def packed(experts: list[torch.Tensor], fmt: str) -> torch.Tensor:
            stacked = torch.stack(experts)
            rows = cpu_ops.to_lanes(stacked.flatten(0, 1).numpy(), fmt)  # row by row: experts stay apart
            return torch.from_numpy(rows).view(stacked.shape[0], stacked.shape[1], -1)

        return cls(*(packed(w, fmt) for w, fmt in zip((gate, up, down), formats, strict=True)), formats)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.gate, self.up, self.down))

    def mixture(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        swiglu: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """The selected experts' weighted sum for a step of few rows (cpu_ops.moe_experts),
        with gpt-oss's expert biases and clamped SwiGLU (alpha, limit) where given."""
        (gate_format, up_format, down_format) = self.formats
        return cpu_ops.moe_experts(
            x, weights, experts, (self.gate, gate_format), (self.up, up_format), (self.down, down_format),
            gate_up_bias=gate_up_bias, down_bias=down_bias, swiglu=swiglu,
        )  # fmt: skip

    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's float32 (gate_up [2I, H], down [H, I]), made for one wide step's GEMM."""
        gate, up, down = (
            cpu_ops.dequantize_blocks(w[expert], fmt)
            for w, fmt in zip((self.gate, self.up, self.down), self.formats, strict=True)
        )
        return torch.cat((gate, up)), down


def mxfp4_experts(blocks: dict[str, torch.Tensor], prefix: str, layer: LlamaLayer) -> QuantizedExperts:
    """gpt-oss's experts from its MXFP4 checkpoint tensors `{prefix}gate_up_proj_blocks` (and
    `_scales`; [E, 2I, G, 16] and [E, 2I, G], gate and up rows interleaved, as
    `stacked_expert_weight` splits the float32 ones) and `{prefix}down_proj_blocks` (and `_scales`),
    kept MXFP4: gate, up and down rows of each expert as GGUF MXFP4 rows (cpu_ops.mxfp4_rows)."""
    num_experts, double_inter, hidden = layer.experts_gate_up.shape
    shapes = {"gate_up_proj": (double_inter, hidden), "down_proj": (hidden, double_inter // 2)}

    def rows(projection: str) -> np.ndarray:
        weight, scales = blocks[f"{prefix}{projection}_blocks"], blocks[f"{prefix}{projection}_scales"]
        out_features, in_features = shapes[projection]
        expected = (num_experts, out_features, in_features // cpu_ops.BLOCK_WEIGHTS, 16)
        if tuple(weight.shape) != expected or tuple(scales.shape) != expected[:3]:
            raise ValueError(
                f"{prefix}{projection}: MXFP4 blocks {tuple(weight.shape)} and scales {tuple(scales.shape)}, "
                f"expected {expected} and {expected[:3]}"
            )
        return cpu_ops.mxfp4_rows(weight.numpy(), scales.numpy())

    gate_up, down = rows("gate_up_proj"), rows("down_proj")
    projections = (gate_up[:, 0::2], gate_up[:, 1::2], down)
    return QuantizedExperts.of(*(list(torch.from_numpy(p)) for p in projections), ("MXFP4",) * 3)


def multiplies_like(blocks: Blocks, weight: torch.Tensor) -> bool:
    """Whether these blocks multiply like `weight` (which loading dequantized from them)."""
    if blocks.out_features != weight.shape[0]:
        return False
    probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = F.linear(probe, weight)
    tolerance = 1e-4 * float(expected.abs().max())
    return torch.allclose(blocks.multiply(probe), expected, rtol=1e-4, atol=tolerance)


# architectures.ACTIVATIONS' gate activations: SiLU, GELU's tanh approximation, and exact GELU (erf).
ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}
FUSED_WEIGHTS = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")  # Phi-3's
# An expert's own weight, as `moe_weight_name` spells it: (layer, expert, projection).
EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# A shared expert's own weight (Qwen2-MoE's shared_expert, DeepSeek's shared_experts): (layer, projection).
SHARED_EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts?\.(gate|up|down)_proj\.weight")
# A part of gpt-oss's MXFP4 experts, one tensor per projection of all experts: (layer, projection, part).
MXFP4_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales)")
# Mixtral's MoE weight names -> the Qwen / OLMoE ones the model loads by (w1 gate, w3 up, w2 down).
MIXTRAL_NAMES = {
    "block_sparse_moe.": "mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


def moe_weight_name(name: str) -> str:
    """A checkpoint weight's name with Mixtral's MoE names as the other families spell them."""
    if ".block_sparse_moe." not in name:
        return name
    for mixtral, common in MIXTRAL_NAMES.items():
        name = name.replace(mixtral, common)
    return name


class LlamaLayer:
    """One decoder layer's weights (this rank's shard of them)."""

    def __init__(
        self,
        config: ModelConfig,
        shard: Shard,
        dtype: torch.dtype,
        device: torch.device,
        is_sparse: bool = False,
    ) -> None:
        def empty(*shape: int) -> torch.Tensor:
            return huge_page_empty(shape, dtype, device)

        h, d = config.hidden_size, config.head_dim
        # DeepSeek's latent attention has its own projections (mla.MlaWeights) instead of qkv.
        self.mla = (
            None if config.mla is None else MlaWeights.empty(config.mla, h, shard.num_heads, dtype, device)
        )
        qkv_size = 0 if self.mla is not None else (shard.num_heads + 2 * shard.num_kv_heads) * d
        self.input_norm = empty(h)
        self.qkv = empty(qkv_size, h)  # column-parallel
        self.qkv_bias = empty(qkv_size) if config.attention_bias else None
        value_dim = d if config.mla is None else config.mla.v_head_dim
        self.o_proj = empty(h, shard.num_heads * value_dim)  # row-parallel
        # Biases of the row-parallel projections are whole: added once, after the all_reduce.
        self.o_bias = empty(h) if config.o_proj_bias else None
        self.sinks = empty(shard.num_heads) if config.attention_sinks else None  # gpt-oss, per query head
        self.pre_mlp_norm = empty(h)
        # Qwen3 / Gemma 3: RMSNorm over each q and k head, before rotary; OLMoE: over all of q and k.
        self.q_norm = (
            empty(d) if config.qk_norm else empty(shard.num_heads * d) if config.qk_norm_whole else None
        )
        self.k_norm = (
            empty(d) if config.qk_norm else empty(shard.num_kv_heads * d) if config.qk_norm_whole else None
        )
        # Gemma 2 / 3: the attention output and the MLP output are normed too, before their residual add.
        self.post_attn_norm = empty(h) if config.sandwich_norms else None
        self.post_mlp_norm = empty(h) if config.sandwich_norms else None
        # A sparse layer's MLP is its experts (below): its dense weights are empty, so every layout's
        # copies of them are too.
        self.moe = config.moe if is_sparse else None
        dense_size = 0 if self.moe is not None else shard.intermediate_size
        self.gate_up = empty(2 * dense_size, h)  # column-parallel
        self.down = empty(h, dense_size)  # row-parallel
        if self.moe is not None:
            e, ei, si = (
                shard.num_local_experts,
                shard.expert_intermediate_size,
                shard.shared_intermediate_size,
            )
            self.expert_start = shard.expert_start
            self.num_local_experts = e
            self.router = empty(self.moe.num_experts, h)  # whole on every rank: each routes every token alike
            self.experts_gate_up = empty(e, 2 * ei, h)  # column-parallel within each expert
            self.experts_down = empty(e, h, ei)  # row-parallel
            # The experts as GGUF blocks, in place of the two above (LlamaModel.load_quantized).
            self.experts_quantized: QuantizedExperts | None = None
            self.shared_gate_up = empty(2 * si, h) if si else None
            self.shared_down = empty(h, si) if si else None
            # The shared expert as GGUF blocks, one expert of them, in place of the two above.
            self.shared_quantized: QuantizedExperts | None = None
            self.shared_expert_gate = empty(1, h) if si and self.moe.shared_expert_gated else None
            self.router_bias = empty(self.moe.num_experts) if self.moe.router_bias else None
            # DeepSeek-V3's e_score_correction_bias, float32 as HF keeps it (it only chooses experts).
            self.router_correction_bias = (
                torch.empty(self.moe.num_experts, dtype=torch.float32, device=device)
                if self.moe.score_correction_bias
                else None
            )
            # The router and the experts as one call for steps of few rows (LlamaModel.finish_loading).
            self.few_rows_moe: FewRowsMoe | None = None
            # gpt-oss: each expert's gate/up bias (this rank's columns) and down bias (whole, added
            # by the rank-0 partial sum only, so the all_reduce adds it once, or with expert
            # parallelism by the expert's own rank: moe_mlp).
            self.experts_gate_up_bias = empty(e, 2 * ei) if self.moe.expert_bias else None
            self.experts_down_bias = empty(e, h) if self.moe.expert_bias else None
        self.gate_up_bias = empty(2 * shard.intermediate_size) if config.mlp_bias else None
        self.down_bias = empty(h) if config.mlp_bias else None
        # (qkv, o_proj, gate_up, down) as [in, out] copies, for steps of few rows without the few-rows
        # kernel (TRANSPOSED_MAX_ROWS), and as oneDNN multiplies them in steps of more (CAN_PREPACK:
        # prepacked where GGUF blocks replace the plain weight, else the plain weight itself):
        # float32 on the CPU only.
        self.transposed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.onednn: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

        # (qkv, o_proj, gate_up, down) in their GGUF block format where the model file has them
        # (LlamaModel.load_quantized); None where it does not.
        self.quantized: tuple[Blocks | None, ...] = (None, None, None, None)

    @property
    def plain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv, self.o_proj, self.gate_up, self.down

    @property
    def few_rows(self) -> tuple[torch.Tensor | Blocks, ...]:
        """What `few_rows_linear` multiplies by: the GGUF blocks where loaded, else the plain weight."""
        return tuple(q if q is not None else w for q, w in zip(self.quantized, self.plain, strict=True))

    @property
    def int8_blocks(self) -> tuple[torch.Tensor | Blocks, ...]:
        """What `int8_blocks_linear` multiplies by in wider steps with 8-bit activations: the GGUF
        blocks where loaded, else the oneDNN copy."""
        assert self.onednn is not None
        return tuple(q if q is not None else w for q, w in zip(self.quantized, self.onednn, strict=True))

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A local expert's (gate_up [2I, H], down [H, I]) as a GEMM multiplies them: slices of the
        float weights, or, for experts kept as blocks, their dequantization (made for this step)."""
        if self.experts_quantized is not None:
            return self.experts_quantized.dequantized(expert)
        return self.experts_gate_up[expert], self.experts_down[expert]

    def shared_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert's (gate_up [2I, H], down [H, I]) as a GEMM multiplies them: the float
        weights, or, kept as blocks, their dequantization (made for this step)."""
        if self.shared_quantized is not None:
            return self.shared_quantized.dequantized(0)
        assert self.shared_gate_up is not None and self.shared_down is not None
        return self.shared_gate_up, self.shared_down

    def few_rows_parts(self) -> list[list[tuple[torch.Tensor, str]]]:
        """`few_rows` as cpu_ops.few_rows_decode_layers takes them: each weight as its parts, a part
        as (tensor, format), format "" for float32 [out, in]."""
        return [
            [(p, "") if isinstance(p, torch.Tensor) else (p.blocks, p.format) for p in parts]
            for parts in (w.parts if isinstance(w, MixedQuantizedWeight) else (w,) for w in self.few_rows)
        ]


def stacked_expert_weight(
    layer: LlamaLayer, key: str, tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(destination, tensor in its layout) of gpt-oss's experts, which its checkpoints stack into
    one tensor per projection, [in, out] per expert (GptOssExperts), gate and up interleaved by
    column (gate_up[..., ::2] is the gate): gate_up_proj [E, H, 2I] (and its bias [E, 2I]) becomes
    the gate rows then the up rows of experts_gate_up [E, 2I, H], down_proj [E, I, H] becomes
    experts_down [E, H, I] (of the experts this rank holds). None for any other key."""
    if key.startswith("mlp.experts.") and layer.experts_gate_up.shape[0] != layer.router.shape[0]:
        tensor = tensor.narrow(0, layer.expert_start, layer.experts_gate_up.shape[0])  # expert parallelism
    if key == "mlp.experts.gate_up_proj":
        return layer.experts_gate_up, torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1).transpose(1, 2)
    if key == "mlp.experts.gate_up_proj_bias" and layer.experts_gate_up_bias is not None:
        return layer.experts_gate_up_bias, torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
    if key == "mlp.experts.down_proj":
        return layer.experts_down, tensor.transpose(1, 2)
    if key == "mlp.experts.down_proj_bias" and layer.experts_down_bias is not None:
        return layer.experts_down_bias, tensor
    return None


# expert_slots' answer for an expert that another rank holds (expert parallelism): not loaded here.
EXPERT_ELSEWHERE = torch.empty(0)


def expert_slots(layer: LlamaLayer, key: str) -> torch.Tensor | None:
    """Where a sparse layer's MoE weight `key` (its name after model.layers.N.) goes: the router
    (gpt-oss's mlp.router, with its bias), an expert's gate / up rows or its down projection
    (EXPERT_ELSEWHERE for an expert of another rank), or the shared expert's; None otherwise."""
    parts = key.split(".")
    if key in ("mlp.gate.weight", "mlp.router.weight"):
        return layer.router
    if key == "mlp.router.bias":
        return layer.router_bias
    if key == "mlp.gate.e_score_correction_bias":
        return layer.router_correction_bias
    if key == "mlp.shared_expert_gate.weight":
        return layer.shared_expert_gate
    if len(parts) == 5 and parts[:2] == ["mlp", "experts"] and parts[4] == "weight":
        expert = int(parts[2])
        if expert >= layer.router.shape[0]:
            raise KeyError(f"expert {expert} of a layer with {layer.router.shape[0]}")
        local = expert - layer.expert_start
        if not 0 <= local < layer.experts_gate_up.shape[0]:
            return EXPERT_ELSEWHERE
        gate_up, down = layer.experts_gate_up[local], layer.experts_down[local]
    elif (
        len(parts) == 4
        and parts[1] in ("shared_expert", "shared_experts")
        and layer.shared_gate_up is not None
    ):  # Qwen2-MoE's shared_expert, DeepSeek's shared_experts
        gate_up, down = layer.shared_gate_up, layer.shared_down
    else:
        return None
    size = down.shape[1]
    return {"gate_proj": gate_up[:size], "up_proj": gate_up[size:], "down_proj": down}.get(parts[-2])


def is_empty_shared_expert(layer: LlamaLayer, key: str) -> bool:
    """A weight of a shared expert of width 0: Qwen2MoeSparseMoeBlock builds its shared expert
    (zero-width projections) and shared_expert_gate even at shared_expert_intermediate_size 0, and
    DeepSeek's MoE its shared_experts at n_shared_experts 0; they add nothing, so the checkpoint
    has them and the model needs none."""
    return (
        layer.moe is not None
        and layer.moe.shared_expert_intermediate_size == 0
        and key.startswith(("mlp.shared_expert.", "mlp.shared_expert_gate.", "mlp.shared_experts."))
    )


class LlamaModel:
    """Owns the weights and runs one step: tokens in, logits of the sampled rows out.

    With tensor parallelism each rank holds a `Shard`: QKV and gate_up are split by output rows
    (heads, MLP columns), o_proj and down by input columns and summed over the ranks (all_reduce);
    the embedding and the LM head are split by vocabulary rows. Every rank gets the full logits.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        parallel: Parallel = Parallel(),  # noqa: B008 (frozen, so one shared default is safe)
        backend: str | None = None,
        int8_activations: bool = False,
        wide_step_dtype: str = "float32",
        has_lm_head: bool = True,
    ) -> None:
        """`has_lm_head` False: an embedding run, which pools the final states and never takes
        logits; an untied head is neither allocated nor required of the checkpoint (a base model's
        save, Qwen3-Embedding's, has none)."""
        self.config = config
        self.has_lm_head = has_lm_head
        self.dtype = dtype
        self.device = device
        self.parallel = parallel
        self.shard = shard = Shard.of(config, parallel)
        self.eps = config.rms_norm_eps
        self.scale = config.softmax_scale
        # Zeroed: the padding rows of the last vocabulary shard must give zero embeddings and logits.
        self.embed = huge_page_zeros((shard.vocab_shard_size, config.hidden_size), dtype, device)
        sparse = config.moe.sparse_layers if config.moe is not None else (False,) * config.num_hidden_layers
        self.layers = [LlamaLayer(config, shard, dtype, device, is_sparse) for is_sparse in sparse]
        self.norm = torch.empty(config.hidden_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = self.embed
        elif has_lm_head:
            self.lm_head = huge_page_zeros(tuple(self.embed.shape), dtype, device)
        else:
            self.lm_head = torch.empty(0, config.hidden_size, dtype=dtype, device=device)
        # One attention backend per distinct (sliding window, rope) of the layers: each prepares
        # its own step metadata (rotary rows, the keys its window reads) once per step.
        self.attention_kinds = sorted(set(zip(config.layer_windows, config.layer_ropes, strict=True)))
        kinds = list(zip(config.layer_windows, config.layer_ropes, strict=True))
        self.layer_kinds = [self.attention_kinds.index(kind) for kind in kinds]
        max_positions = config.max_position_embeddings
        tables = [
            rope_cos_sin(r, config.head_dim, max_positions, dtype, device, config.rotary_dim)
            for r in config.ropes
        ]
        self.kind_ops = []
        for window, rope in self.attention_kinds:
            shapes = Shapes(
                shard.num_heads, shard.num_kv_heads, config.head_dim, block_size, tables[rope],
                window=window, softcap=config.attn_softcap,
                long_rope_rows=max_positions if config.ropes[rope].rope_type == "longrope" else 0,
                mrope_section=config.ropes[rope].mrope_section,
            )  # fmt: skip
            # Latent attention runs its own torch path on every device (mla.py).
            self.kind_ops.append(
                MlaOps(shapes, device, dtype)
                if config.mla is not None
                else make_ops(shapes, device, dtype, backend)
            )
        # Latent attention: decode rows in the absorbed form (mla.absorbed), or up-projected like
        # prefill rows where False (the tests run both).
        self.mla_absorbed_decode = True
        self.ops = self.kind_ops[0]  # also runs the norms
        # The Triton backend's MoE experts: two grouped GEMMs (imported only there, like its
        # other kernels, so CPU-only hosts never need Triton); latent attention's models take
        # them where that backend would run, though their attention stays torch.
        self.fused_experts: Callable[..., torch.Tensor] | None = None
        self.is_triton = (backend or ("triton" if device.type == "cuda" else "torch")) == "triton"
        if config.moe is not None and self.is_triton:
            from kernels.fused_moe import fused_moe_triton

            self.fused_experts = fused_moe_triton
        self.shapes = self.ops.s
        is_half = dtype in (torch.bfloat16, torch.float16)
        self.upcast_min_rows = sys.maxsize
        if is_half and not has_native_half_matmul(device):
            self.upcast_min_rows = UPCAST_MIN_ROWS
        self.is_cpu_float32 = device.type == "cpu" and dtype == torch.float32
        self.has_few_rows_linear = self.is_cpu_float32 and cpu_ops.has_kernels(dtype)
        self.lm_head_t: torch.Tensor | None = (
            None  # [in, out] copy of lm_head, CPU float32 without the kernel
        )
        # CPU with CAN_PREPACK: float32 or, with bf16 wide steps, bfloat16 (WIDE_STEP_DTYPES)
        self.lm_head_onednn: torch.Tensor | None = None
        self.lm_head_quantized: Blocks | None = None  # see load_quantized
        # Decode steps of few rows run each layer as one C++ op (one rank: no all_reduce inside),
        # where the layer is exactly what that op computes.
        self.has_one_op_layers = (
            self.has_few_rows_linear and not parallel.is_parallel and config.is_plain_llama
        )
        # engine.cpu_int8_activations: steps of up to int8_blocks_max_rows rows multiply the GGUF
        # blocks by 8-bit activations (cpu_ops.linear_quantized_int8), as llama.cpp does;
        # float32 weights and wider steps are unchanged.
        self.int8_activations = int8_activations
        self.int8_blocks_max_rows = INT8_BLOCKS_MAX_ROWS[cpu_ops.isa()]
        self.wide_step_dtype = self._wide_step_dtype(wide_step_dtype)
        self._loaded: set[str] = set()

    def _wide_step_dtype(self, wanted: str) -> torch.dtype:
        """The dtype of the oneDNN weight copies (WIDE_STEP_DTYPES): bfloat16 where asked for and
        this CPU multiplies it natively, else float32 (with a warning where it was asked for)."""
        if wanted not in WIDE_STEP_DTYPES:
            raise ValueError(f"wide_step_dtype {wanted!r}: expected one of {', '.join(WIDE_STEP_DTYPES)}")
        if wanted == "float32":
            return torch.float32
        if not (self.is_cpu_float32 and CAN_PREPACK):
            reason = "applies to the CPU path in float32 with oneDNN only"
        elif not has_native_half_matmul(self.device):
            # oneDNN would emulate bf16 there, slower than float32.
            reason = "this CPU has neither AVX-512 BF16 nor AMX"
        else:
            return torch.bfloat16
        log.warning("wide steps in bfloat16: %s; they stay float32", reason)
        return torch.float32

    # ---- weights ----------------------------------------------------------------------------------

    def shard_spec(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's slice of the HF weight `name`; None = the whole
        tensor (always, with one rank, so loading is unchanged)."""
        if not self.parallel.is_parallel:
            return None
        sh, d = self.shard, self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, sh.vocab_start, sh.num_vocab_rows
        key = ".".join(moe_weight_name(name).split(".")[3:])
        if key.startswith("mlp.experts.") and key.count(".") == 2:  # gpt-oss's stacked experts
            start, size = sh.expert_intermediate_start, sh.expert_intermediate_size
            # gate_up's columns interleave gate and up, so a rank's columns are one run of 2 * size.
            stacked = {"gate_up_proj": (2, 2 * start, 2 * size), "gate_up_proj_bias": (1, 2 * start, 2 * size),
                       "down_proj": (1, start, size)}  # fmt: skip
            return stacked.get(key.rsplit(".", 1)[1])  # down_proj_bias: whole (LlamaLayer)
        if key == "self_attn.sinks":
            return 0, sh.head_start, sh.num_heads
        if self.config.qk_norm_whole and key == "self_attn.q_norm.weight":  # OLMoE's: over all heads
            return 0, sh.head_start * d, sh.num_heads * d
        if self.config.qk_norm_whole and key == "self_attn.k_norm.weight":
            return 0, sh.kv_head_start * d, sh.num_kv_heads * d
        projection, _, kind = key.rpartition(".")
        if projection.startswith(("mlp.experts.", "mlp.shared_expert.", "mlp.shared_experts.")):
            if projection.startswith("mlp.experts."):
                start, size = sh.expert_intermediate_start, sh.expert_intermediate_size
            else:
                start, size = sh.shared_intermediate_start, sh.shared_intermediate_size
            return (1, start, size) if projection.endswith("down_proj") else (0, start, size)
        if kind == "bias" and projection in ("self_attn.o_proj", "mlp.down_proj"):
            return None  # whole on every rank (LlamaLayer.o_bias)
        mla = self.config.mla
        if mla is not None:  # the per-head projections by heads; q_a, kv_a and the norms whole
            per_head = {
                "self_attn.q_proj": (0, mla.qk_head_dim), "self_attn.q_b_proj": (0, mla.qk_head_dim),
                "self_attn.kv_b_proj": (0, mla.qk_nope_head_dim + mla.v_head_dim),
                "self_attn.o_proj": (1, mla.v_head_dim),
            }.get(projection)  # fmt: skip
            if per_head is not None:
                dim, width = per_head
                return dim, sh.head_start * width, sh.num_heads * width
        if projection == "self_attn.q_proj":
            return 0, sh.head_start * d, sh.num_heads * d
        if projection in ("self_attn.k_proj", "self_attn.v_proj"):
            return 0, sh.kv_head_start * d, sh.num_kv_heads * d
        if projection == "self_attn.o_proj":
            return 1, sh.head_start * d, sh.num_heads * d
        if projection in ("mlp.gate_proj", "mlp.up_proj"):
            return 0, sh.intermediate_start, sh.intermediate_size
        if projection == "mlp.down_proj":
            return 1, sh.intermediate_start, sh.intermediate_size
        return None

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one HF-named weight (this rank's slice of it, see `shard_spec`) into its
        (possibly merged) slot."""
        if name.endswith("rotary_emb.inv_freq"):
            return
        name = moe_weight_name(name)
        c, sh = self.config, self.shard
        if c.fused_weights and name.endswith(FUSED_WEIGHTS):
            # Phi-3's qkv_proj / gate_up_proj (whole: shard_spec does not slice them) as the
            # q/k/v and gate/up weights they stack, each then sliced like a checkpoint's own.
            prefix, fused = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            parts = (
                {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
                if fused == "qkv_proj"
                else {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size}
            )
            if tensor.shape[0] != sum(parts.values()):
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(parts.values())}")
            for part, piece in zip(parts, tensor.split(list(parts.values())), strict=True):
                part_name = f"{prefix}.{part}.weight"
                spec = self.shard_spec(part_name)
                self.load_hf_weight(part_name, piece if spec is None else piece.narrow(*spec))
            return
        q_size, kv_size = sh.num_heads * c.head_dim, sh.num_kv_heads * c.head_dim
        inter = sh.intermediate_size
        if name == "model.embed_tokens.weight":
            dst = self.embed[: sh.num_vocab_rows]
        elif name == "model.norm.weight":
            dst = self.norm
        elif name == "lm_head.weight":
            if c.tie_word_embeddings or not self.has_lm_head:
                return
            dst = self.lm_head[: sh.num_vocab_rows]
        else:
            parts = name.split(".")
            if c.mla is not None and parts[:2] == ["model", "layers"] and int(parts[2]) >= len(self.layers):
                return  # DeepSeek-V3's multi-token-prediction layers, which only speculation would run
            if parts[:2] != ["model", "layers"] or int(parts[2]) >= len(self.layers):
                raise KeyError(f"unexpected weight {name}")
            layer = self.layers[int(parts[2])]
            key = ".".join(parts[3:])
            merged = {
                "mlp.gate_proj.weight": (layer.gate_up, 0, inter),
                "mlp.up_proj.weight": (layer.gate_up, inter, inter),
            }
            if layer.mla is None:  # (DeepSeek-V2-Lite's q_proj is one of its latent attention's)
                merged["self_attn.q_proj.weight"] = (layer.qkv, 0, q_size)
                merged["self_attn.k_proj.weight"] = (layer.qkv, q_size, kv_size)
                merged["self_attn.v_proj.weight"] = (layer.qkv, q_size + kv_size, kv_size)
            if layer.qkv_bias is not None:
                merged["self_attn.q_proj.bias"] = (layer.qkv_bias, 0, q_size)
                merged["self_attn.k_proj.bias"] = (layer.qkv_bias, q_size, kv_size)
                merged["self_attn.v_proj.bias"] = (layer.qkv_bias, q_size + kv_size, kv_size)
            if layer.gate_up_bias is not None:
                merged["mlp.gate_proj.bias"] = (layer.gate_up_bias, 0, inter)
                merged["mlp.up_proj.bias"] = (layer.gate_up_bias, inter, inter)
            plain = {
                "input_layernorm.weight": layer.input_norm,
                "self_attn.o_proj.weight": layer.o_proj,
                "mlp.down_proj.weight": layer.down,
                "self_attn.q_norm.weight": layer.q_norm,
                "self_attn.k_norm.weight": layer.k_norm,
                "self_attn.o_proj.bias": layer.o_bias,
                "mlp.down_proj.bias": layer.down_bias,
                "self_attn.sinks": layer.sinks,
            }
            if layer.mla is not None:
                plain.update({f"self_attn.{k}": w for k, w in layer.mla.slots().items()})
            if c.sandwich_norms:  # Gemma's post_attention_layernorm norms the attention output
                plain["post_attention_layernorm.weight"] = layer.post_attn_norm
                plain["pre_feedforward_layernorm.weight"] = layer.pre_mlp_norm
                plain["post_feedforward_layernorm.weight"] = layer.post_mlp_norm
            else:
                plain["post_attention_layernorm.weight"] = layer.pre_mlp_norm
            expert_dst = expert_slots(layer, key) if layer.moe is not None else None
            stacked = stacked_expert_weight(layer, key, tensor) if layer.moe is not None else None
            if stacked is not None:
                dst, tensor = stacked
            elif expert_dst is EXPERT_ELSEWHERE:
                self._loaded.add(name)
                return
            elif expert_dst is not None:
                dst = expert_dst
            elif key in merged:
                whole, start, size = merged[key]
                dst = whole.narrow(0, start, size)
                if c.rotary_dim and key.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
                    heads = tensor.reshape(-1, c.head_dim, *tensor.shape[1:])  # this rank's whole heads
                    order = rotary_order(c.head_dim, c.rotary_dim)
                    tensor = heads.index_select(1, order).reshape(tensor.shape)
            elif plain.get(key) is not None:
                dst = plain[key]
            elif is_empty_shared_expert(layer, key):
                return
            else:
                raise KeyError(f"unexpected weight {name}")
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        if c.norm_plus_one and name.endswith("norm.weight"):
            dst.add_(1.0)  # Gemma's norms scale by (1 + w): stored as such once
        self._loaded.add(name)

    def expected_weights(self) -> set[str]:
        """The HF names of every weight the model needs (fused checkpoints' split into their parts,
        Mixtral's MoE names as `moe_weight_name` spells them)."""
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings and self.has_lm_head:
            names.add("lm_head.weight")
        per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.o_proj"]
        if c.mla is None:
            per_layer += [f"self_attn.{p}_proj" for p in "qkv"]
        else:
            per_layer += [f"self_attn.{k.removesuffix('.weight')}" for k in self.layers[0].mla.slots()]
        if c.qk_norm or c.qk_norm_whole:
            per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
        sinks = ["self_attn.sinks"] if c.attention_sinks else []
        if c.sandwich_norms:
            per_layer += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        biases = [f"self_attn.{p}_proj.bias" for p in "qkv"] if c.attention_bias else []
        biases += ["self_attn.o_proj.bias"] if c.o_proj_bias else []
        biases += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")] if c.mlp_bias else []
        for i, layer in enumerate(self.layers):
            names.update(f"model.layers.{i}.{w}.weight" for w in per_layer)
            names.update(f"model.layers.{i}.{b}" for b in biases + sinks)
            projections = [f"{p}_proj" for p in ("gate", "up", "down")]
            mlp = [f"mlp.{p}" for p in projections]
            if layer.moe is not None and layer.moe.expert_bias:  # gpt-oss: stacked experts, biases
                names.update(f"model.layers.{i}.mlp.{w}" for w in (
                    "router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
                    "experts.down_proj", "experts.down_proj_bias",
                ))  # fmt: skip
                continue
            if layer.moe is not None:
                mlp = ["mlp.gate"]
                mlp += [f"mlp.experts.{e}.{p}" for e in range(layer.moe.num_experts) for p in projections]
                if layer.shared_expert_gate is not None:  # Qwen2-MoE's
                    mlp += ["mlp.shared_expert_gate"] + [f"mlp.shared_expert.{p}" for p in projections]
                elif layer.shared_gate_up is not None:  # DeepSeek's
                    mlp += [f"mlp.shared_experts.{p}" for p in projections]
                if layer.router_correction_bias is not None:
                    names.add(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
            names.update(f"model.layers.{i}.{w}.weight" for w in mlp)
        return names

    @property
    def takes_quantized(self) -> bool:
        """Whether `load_quantized` would use GGUF blocks: the few-rows kernel, one rank."""
        return self.has_few_rows_linear and not self.parallel.is_parallel

    def quantized_expert_names(self, formats: dict[str, str]) -> set[str]:
        """The checkpoint names of the expert weights that stay blocks (`load_quantized`), so that
        the loader never dequantizes them, on the few-rows CPU path (`takes_quantized`, not the
        Triton backend), in each sparse layer whose experts all have blocks of a format the
        kernels read (cpu_ops.EXPERT_FORMATS): every expert's gate, up and down (a GGUF's), or
        gpt-oss's MXFP4 gate_up and down blocks and scales (`load_weights` names those MXFP4).
        So do a shared expert's gate, up and down (Qwen2-MoE's, DeepSeek's) where all three are
        blocks of such a format, whatever the routed experts are: every token runs it, so its
        bytes are read at every step. cpu_ops.moe_experts computes SiLU experts and
        gpt-oss's biased, clamped ones."""
        if not self.takes_quantized or self.fused_experts is not None or self.config.activation != "silu":
            return set()
        by_layer: dict[int, dict[str, str]] = {}
        shared_by_layer: dict[int, dict[str, str]] = {}
        for name, fmt in formats.items():
            match = EXPERT_WEIGHT.fullmatch(moe_weight_name(name)) or MXFP4_EXPERTS.fullmatch(name)
            if match:
                by_layer.setdefault(int(match[1]), {})[name] = fmt
            elif match := SHARED_EXPERT_WEIGHT.fullmatch(name):
                shared_by_layer.setdefault(int(match[1]), {})[name] = fmt
        kept: set[str] = set()
        for index, names in shared_by_layer.items():
            layer = self.layers[index] if index < len(self.layers) else None
            has_shared = layer is not None and layer.moe is not None and layer.shared_gate_up is not None
            if (
                has_shared
                and len(names) == 3
                and all(fmt in cpu_ops.EXPERT_FORMATS for fmt in names.values())
            ):
                kept.update(names)
        for index, names in by_layer.items():
            layer = self.layers[index] if index < len(self.layers) else None
            moe = None if layer is None else layer.moe
            if moe is None:
                continue
            # gpt-oss's two stacked projections, blocks and scales each; else 3 weights an expert.
            is_stacked = all(MXFP4_EXPERTS.fullmatch(name) for name in names)
            if is_stacked != moe.expert_bias or len(names) != (4 if is_stacked else 3 * moe.num_experts):
                continue
            if all(fmt in cpu_ops.EXPERT_FORMATS for fmt in names.values()):
                kept.update(names)
        return kept

    @property
    def reads_gguf_blocks(self) -> bool:
        """Whether steps of few rows multiply any weight from its GGUF blocks (after `load_quantized`)."""
        quantized = [q for layer in self.layers for q in layer.quantized] + [self.lm_head_quantized]
        return any(q is not None for q in quantized)

    def load_quantized(self, blocks: dict[str, torch.Tensor], formats: dict[str, str]) -> None:
        """Multiply steps of few rows from GGUF blocks (HF names) where they hold exactly the
        weights loaded: each fused weight is checked against its float32 copy, and one that
        differs stays float32, with a warning; so does, silently, one with a part that has no
        blocks or blocks of a format the kernels do not read."""

        def quantized(names: list[str], weight: torch.Tensor) -> Blocks | None:
            if not all(name in blocks for name in names):
                return None
            fused = blocks_of([blocks[n] for n in names], [formats[n] for n in names])
            if fused is not None and not multiplies_like(fused, weight):
                log.warning("%s: the GGUF blocks do not match the loaded weights; using float32", names[0])
                return None
            return fused

        for i, layer in enumerate(self.layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            names = (
                [attn + f"{p}_proj.weight" for p in "qkv"],
                [attn + "o_proj.weight"],
                [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                [mlp + "down_proj.weight"],
            )
            layer.quantized = tuple(quantized(n, w) for n, w in zip(names, layer.plain, strict=True))
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        if self.has_lm_head:
            self.lm_head_quantized = quantized([head], self.lm_head)
        self._load_quantized_experts(blocks, formats)

    def _load_quantized_experts(self, blocks: dict[str, torch.Tensor], formats: dict[str, str]) -> None:
        """The experts `quantized_expert_names` keeps as blocks (which the loader did not
        dequantize), in place of the float32 expert weights, released unwritten; a shared expert
        as a `QuantizedExperts` of one expert, which moe_mlp runs as every row's only choice.
        There is no float32 copy to check them against: the float32 weights would be these
        blocks' dequantization (loader.iter_weights), which the kernels' tests hold them to."""
        kept = self.quantized_expert_names(formats)
        by_name = {moe_weight_name(name): name for name in kept}
        for i, layer in enumerate(self.layers):
            shared = [  # gate, up, down, of Qwen2-MoE's shared_expert or DeepSeek's shared_experts
                name
                for module in ("shared_expert", "shared_experts")
                for p in ("gate", "up", "down")
                if (name := f"model.layers.{i}.mlp.{module}.{p}_proj.weight") in kept
            ]
            if shared:
                self._loaded.update(shared)
                layer.shared_quantized = QuantizedExperts.of(
                    *([blocks[name]] for name in shared), tuple(formats[name] for name in shared)
                )
                layer.shared_gate_up = layer.shared_down = torch.empty(
                    0, dtype=self.dtype, device=self.device
                )
            stacked = f"model.layers.{i}.mlp.experts."
            if stacked + "gate_up_proj_blocks" in kept:
                layer.experts_quantized = mxfp4_experts(blocks, stacked, layer)
                self._loaded.update((stacked + "gate_up_proj", stacked + "down_proj"))
            elif stacked + "0.gate_proj.weight" in by_name:
                assert layer.moe is not None
                names = [
                    [by_name[f"{stacked}{e}.{p}_proj.weight"] for e in range(layer.moe.num_experts)]
                    for p in ("gate", "up", "down")
                ]
                self._loaded.update(moe_weight_name(name) for projection in names for name in projection)
                # One GGUF tensor holds a projection of all experts: expert 0's format is every one's.
                layer_formats = tuple(formats[projection[0]] for projection in names)
                layer.experts_quantized = QuantizedExperts.of(
                    *([blocks[name] for name in projection] for projection in names), layer_formats
                )
            else:
                continue
            layer.experts_gate_up = layer.experts_down = torch.empty(0, dtype=self.dtype, device=self.device)

    def finish_loading(self) -> None:
        """Fail loudly on missing weights (a silently random layer would still 'work'); on the
        CPU in float32, make the copies the kernels read (after `load_quantized`, if any)."""
        missing = sorted(self.expected_weights() - self._loaded)
        if missing:
            raise ValueError(f"{len(missing)} weights missing from the checkpoint, e.g. {missing[:3]}")
        if not self.is_cpu_float32:
            return
        is_silu = self.config.activation == "silu"
        adds_down_bias = self.parallel.rank == 0 or self.parallel.expert_parallel
        for layer in self.layers:
            if layer.moe is not None:
                layer.few_rows_moe = FewRowsMoe.of(layer, self.has_few_rows_linear, is_silu, adds_down_bias)
        keep_transposed = not self.has_few_rows_linear
        # One float32 copy of each weight (CAN_PREPACK): a plain [out, in] weight that has GGUF
        # blocks is read by no step once prepacked (steps of few rows multiply by the blocks), so
        # it is replaced by its prepacked copy, layer by layer, and the peak while loading stays
        # one copy too; every other weight stays plain, for the few-rows kernel and oneDNN alike.
        # With bf16 wide steps (WIDE_STEP_DTYPES) oneDNN's copy of every layer weight is a
        # prepacked bfloat16 one: in place of the float32 weight where that has blocks, beside it
        # where the few-rows kernel still reads it.
        drops_plain = CAN_PREPACK and not keep_transposed
        is_bf16 = self.wide_step_dtype == torch.bfloat16
        released = torch.empty(0, dtype=self.dtype, device=self.device)
        for layer in self.layers:
            if keep_transposed:
                layer.transposed = tuple(w.t().contiguous() for w in layer.plain)  # type: ignore[assignment]
            if not CAN_PREPACK:
                continue
            names = ("qkv", "o_proj", "gate_up", "down")
            onednn = []
            for name, weight, blocks in zip(names, layer.plain, layer.quantized, strict=True):
                if drops_plain and blocks is not None:
                    onednn.append(prepack(weight.bfloat16() if is_bf16 else weight))
                    setattr(layer, name, released)
                elif is_bf16 and weight.numel():  # a sparse layer's dense weights are empty: nothing to pack
                    onednn.append(prepack(weight.bfloat16()))
                else:
                    onednn.append(weight)
            layer.onednn = tuple(onednn)  # type: ignore[assignment]
        if keep_transposed:
            self.lm_head_t = self.lm_head.t().contiguous()
        if CAN_PREPACK:
            # The head's float32 copy goes where only oneDNN would read it: an untied head with
            # GGUF blocks. A tied one is the embedding, which lookups read; one without blocks is
            # what steps of few rows multiply. An embedding run has no head (an empty tensor).
            drops_head = (
                drops_plain and self.lm_head_quantized is not None and not self.config.tie_word_embeddings
            )
            if is_bf16 and self.has_lm_head:
                self.lm_head_onednn = prepack(self.lm_head.bfloat16())
            elif drops_head:
                self.lm_head_onednn = prepack(self.lm_head)
            else:
                self.lm_head_onednn = self.lm_head
            if drops_head:
                self.lm_head = released

    # ---- forward ----------------------------------------------------------------------------------

    def prepare(
        self,
        arrays: dict[str, np.ndarray],
        num_tokens: int,
        num_seqs: int,
        rope_positions: np.ndarray | None = None,
    ) -> list[StepMeta]:
        """The step's attention metadata, one per attention kind (see `attention_kinds`);
        `rope_positions`: M-RoPE's [3, T] (attention.mrope_positions), None for the plan's."""
        return [ops.prepare(arrays, num_tokens, num_seqs, rope_positions) for ops in self.kind_ops]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        metas: list[StepMeta],
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        sample_tokens: torch.Tensor,
        lora: ProjectionDeltas | None = None,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """Run all tokens; returns float32 logits [len(sample_tokens), V] of the sampled rows only."""
        hidden, residual = self.hidden_states(input_ids, metas, kv_cache, lora, images)
        return self.logits(hidden, residual, sample_tokens)

    @cached_property
    def decode_layers(self) -> cpu_ops.DecodeLayers:
        """The layers as cpu_ops.few_rows_decode_layers takes them, made by the first decode step
        that takes that op, after loading (the weights do not change then)."""
        norms, weights, formats, counts = [], [], [], []
        for layer in self.layers:
            norms += [layer.input_norm, layer.pre_mlp_norm]
            for parts in layer.few_rows_parts():
                counts.append(len(parts))
                weights += [tensor for tensor, _ in parts]
                formats += [fmt for _, fmt in parts]
        return cpu_ops.DecodeLayers(
            norms, weights, formats, counts, [layer.qkv_bias for layer in self.layers]
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        metas: list[StepMeta],
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        lora: ProjectionDeltas | None = None,
        images: ImageRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run all tokens through the layers; returns the last layer's output and residual, whose
        sum (at the rows wanted) `logits` takes through the final norm and the LM head. `lora`:
        the step's adapters, added to each projection's output for the tokens that use one.
        `images`: the encoder's embeddings of the step's image tokens, which take those tokens'
        places as they are (after the embedding scale, as HF's Gemma 3 puts them)."""
        c, ops, eps, scale = self.config, self.ops, self.eps, self.scale
        reduce = self.parallel.all_reduce  # the identity with one rank
        num_tokens = input_ids.shape[0]
        layout = self._layout(num_tokens)
        linear = self._linear(layout, num_tokens)
        hidden = self.embed_tokens(input_ids)
        if c.embed_scale != 1.0:
            # As HF does: the scale rounded to the activations' dtype first.
            hidden = hidden * torch.tensor(c.embed_scale, dtype=hidden.dtype)
        if images is not None:
            hidden[images.tokens] = images.embeddings.to(hidden.device, hidden.dtype)
        activation = ACTIVATION_FUNCTIONS[c.activation]
        residual = None
        meta = metas[0]
        # A decode step of a few sequences runs all its layers in one C++ op
        # (cpu_ops.few_rows_decode_layers), adapter deltas included.
        if (
            self.has_one_op_layers
            and layout == "few_rows"
            and meta.decode_tables is not None
            and meta.is_all_decode
            and meta.store_tokens is None
        ):
            return cpu_ops.few_rows_decode_layers(
                hidden, self.decode_layers, eps, meta.cos.view(num_tokens, -1), meta.sin.view(num_tokens, -1),
                ([k for k, _ in kv_cache], [v for _, v in kv_cache]), meta.slot_mapping, meta.decode_tables,
                meta.decode_lens, self.shapes.num_heads, scale, self.int8_activations,
                () if lora is None else lora.decode_arguments(),
            )  # fmt: skip
        for index, (layer, layer_cache, kind) in enumerate(
            zip(self.layers, kv_cache, self.layer_kinds, strict=True)
        ):
            k_cache, v_cache = layer_cache
            layer_ops, layer_meta = self.kind_ops[kind], metas[kind]
            qkv_w, o_proj_w, gate_up_w, down_w = getattr(layer, layout)
            x, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            if layer.mla is not None:  # its caches: the latents and the rope keys
                attn_out = mla_attention(
                    x, layer.mla, k_cache, v_cache, layer_meta, scale, plain_linear(self.has_few_rows_linear, x),
                    self.mla_absorbed_decode,
                )  # fmt: skip
            else:
                attn_out = self._attention(
                    x, index, layer, layer_ops, layer_meta, k_cache, v_cache, linear, qkv_w, lora
                )
            attn = linear(attn_out, o_proj_w)
            if lora is not None:
                lora.add(attn, attn_out, index, ("o_proj",))
            attn = reduce(attn)
            if layer.o_bias is not None:
                attn.add_(layer.o_bias)
            if layer.post_attn_norm is not None:
                attn, _ = ops.rms_norm(attn, layer.post_attn_norm, eps, None)
            x, residual = ops.rms_norm(attn, layer.pre_mlp_norm, eps, residual)
            if layer.moe is not None:
                hidden = reduce(
                    moe_mlp(
                        x, layer, activation, self.has_few_rows_linear, self.fused_experts,
                        adds_down_bias=self.parallel.rank == 0 or self.parallel.expert_parallel,
                    )
                )  # fmt: skip
            else:
                gate_up = linear(x, gate_up_w, layer.gate_up_bias)
                if lora is not None:
                    lora.add(gate_up, x, index, ("gate_proj", "up_proj"))
                gate, up = gate_up.chunk(2, dim=-1)
                # In place on the activation's fresh output: one allocation less per layer.
                glu = activation(gate).mul_(up)
                hidden = linear(glu, down_w)
                if lora is not None:
                    lora.add(hidden, glu, index, ("down_proj",))
                hidden = reduce(hidden)
            if layer.down_bias is not None:
                hidden.add_(layer.down_bias)
            if layer.post_mlp_norm is not None:
                hidden, _ = ops.rms_norm(hidden, layer.post_mlp_norm, eps, None)
        return hidden, residual

    def _attention(
        self,
        x: torch.Tensor,
        index: int,
        layer: LlamaLayer,
        layer_ops: TorchOps | TritonOps,
        layer_meta: StepMeta,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        linear: Callable[..., torch.Tensor],
        qkv_w: torch.Tensor | Blocks,
        lora: ProjectionDeltas | None,
    ) -> torch.Tensor:
        """q, k and v heads' attention of x [T, hidden] (normed) -> [T, heads * head_dim], for o_proj."""
        c, eps = self.config, self.eps
        qk_norms = None if layer.q_norm is None or c.qk_norm_whole else (layer.q_norm, layer.k_norm, eps)
        qkv = linear(x, qkv_w, layer.qkv_bias)
        if lora is not None:
            lora.add(qkv, x, index, ("q_proj", "k_proj", "v_proj"))
        if c.qk_norm_whole:
            whole = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim)
            qkv = norm_whole_qk(qkv, layer.q_norm, layer.k_norm, eps, self.parallel, whole)
        if c.clip_qkv:
            qkv = qkv.clamp_(-c.clip_qkv, c.clip_qkv)
        q, k, v = layer_ops.qkv_rotary(qkv, layer_meta, qk_norms)
        return layer_ops.attention(q, k, v, k_cache, v_cache, layer_meta, self.scale, layer.sinks)

    def final_states(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Every token's state after the final norm (what the LM head reads; HF's last hidden
        state), for an embedding run's pooling."""
        x, _ = self.ops.rms_norm((hidden + residual).contiguous(), self.norm, self.eps, None)
        return x

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(tokens), V] of these rows of `hidden_states`' output: only they go
        through the final norm and the LM head."""
        c, ops, eps = self.config, self.ops, self.eps
        last = (hidden[tokens] + residual[tokens]).contiguous()
        x, _ = ops.rms_norm(last, self.norm, eps, None)
        num_sampled = last.shape[0]
        lm_layout = self._layout(num_sampled)
        if lm_layout == "plain" and num_sampled >= self.upcast_min_rows:
            logits = F.linear(x.float(), self.lm_head.float())  # float32 logits, not rounded back
        else:
            lm_head = {
                "plain": self.lm_head,
                "few_rows": self.lm_head if self.lm_head_quantized is None else self.lm_head_quantized,
                "transposed": self.lm_head_t,
                "onednn": self.lm_head_onednn,
                "int8_blocks": self.lm_head_onednn
                if self.lm_head_quantized is None
                else self.lm_head_quantized,
            }
            logits = self._linear(lm_layout, num_sampled)(x, lm_head[lm_layout]).float()
        if self.parallel.is_parallel:
            logits = self.parallel.all_gather_last(logits)[:, : self.config.vocab_size]
        if c.final_softcap:
            logits = torch.tanh(logits / c.final_softcap).mul_(c.final_softcap)
        return logits

    def _layout(self, num_rows: int) -> str:
        """Which copy of the weights (a LlamaLayer attribute) multiplies a step of this many rows."""
        if self.has_few_rows_linear and num_rows <= cpu_ops.MAX_LINEAR_ROWS:
            return "few_rows"
        if (
            self.int8_activations
            and self.has_few_rows_linear
            and self.lm_head_onednn is not None
            and num_rows <= self.int8_blocks_max_rows
        ):
            return "int8_blocks"
        if self.lm_head_t is not None and num_rows <= TRANSPOSED_MAX_ROWS:
            return "transposed"
        return "plain" if self.lm_head_onednn is None else "onednn"

    def _linear(self, layout: str, num_rows: int) -> Callable[..., torch.Tensor]:
        if layout == "few_rows":
            return (
                partial(few_rows_linear, int8_activations=True) if self.int8_activations else few_rows_linear
            )
        if layout == "int8_blocks":
            return int8_blocks_linear
        if layout == "transposed":
            return linear_t
        if layout == "onednn":
            return onednn_linear
        return upcast_linear if num_rows >= self.upcast_min_rows else F.linear

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; with vocabulary shards each rank looks up its own ids, zeros the rest,
        and the sum over the ranks is the full lookup."""
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.shard.vocab_start
        is_mine = (local >= 0) & (local < self.shard.num_vocab_rows)
        hidden = F.embedding(torch.where(is_mine, local, 0), self.embed)
        return self.parallel.all_reduce(hidden.masked_fill_(~is_mine.unsqueeze(-1), 0))


def norm_whole_qk(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    parallel: Parallel = Parallel(),  # noqa: B008 (frozen, so one shared default is safe)
    whole: tuple[int, int] | None = None,
) -> torch.Tensor:
    """OLMoE's q and k norms: RMSNorm over the whole q projection and the whole k projection of
    qkv [T, q + 2 kv] (all heads at once, as OlmoeAttention does), v unchanged. With tensor
    parallelism a rank holds its heads' share of q and k and of the norms' weights: the ranks add
    up their sums of squares (one all_reduce of [2, T]) and divide by the whole sizes `whole`
    (q's, k's)."""
    q_size, kv_size = q_norm.shape[0], k_norm.shape[0]
    q, k, v = qkv.split((q_size, kv_size, qkv.shape[1] - q_size - kv_size), dim=-1)
    if not parallel.is_parallel:
        return torch.cat(
            (F.rms_norm(q, (q_size,), q_norm, eps), F.rms_norm(k, (kv_size,), k_norm, eps), v), dim=-1
        )
    assert whole is not None
    squares = parallel.all_reduce(torch.stack((q.float().square().sum(-1), k.float().square().sum(-1))))
    scales = torch.rsqrt(squares / squares.new_tensor(whole).unsqueeze(-1) + eps)
    # In float32, then back to the model's dtype before the weight, as HF's RMSNorm does.
    q, k = (
        (part.float() * scale.unsqueeze(-1)).to(qkv.dtype) for part, scale in zip((q, k), scales, strict=True)
    )
    return torch.cat((q * q_norm, k * k_norm, v), dim=-1)


def moe_route(
    router_logits: torch.Tensor, moe: MoeConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) [T, top_k] of each token, as the HF MoE routers compute them: softmax
    (or DeepSeek-V3's sigmoid) scores of all experts in float32, the top k (torch.topk, so ties
    break as HF's do), renormalized to sum to 1 where norm_topk_prob, times routed_scaling_factor;
    or, with softmax_after_topk (gpt-oss), the top k of the logits and a softmax over those k (the
    same experts: softmax keeps the order). DeepSeek chooses by the scores plus V3's
    `correction_bias` and only among the experts of the best groups (`limit_to_groups`), but
    weights by the scores themselves."""
    if moe.softmax_after_topk:
        top_logits, experts = torch.topk(router_logits, moe.top_k, dim=-1)
        return torch.softmax(top_logits.float(), dim=-1), experts
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if moe.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.num_groups > 1:
        choice = limit_to_groups(choice, moe)
    experts = torch.topk(choice, moe.top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        weights *= moe.routed_scaling_factor
    return weights, experts


def route_experts(x: torch.Tensor, layer: LlamaLayer, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse layer's (weights, experts) for x: `moe_route` on the router's logits, or, for a
    softmax router and a step of few rows on the CPU, cpu_ops.moe_route's one call (at one row the
    five torch ops cost more in dispatch than their work), unless a row's choice is a tie that
    torch.topk breaks its own way."""
    if (
        len(x) <= cpu_ops.MOE_MAX_ROWS
        and x.device.type == "cpu"
        and has_cpu_router(layer, moe)
        and cpu_ops.has_kernels(x.dtype)
    ):
        weights, experts, tied = cpu_ops.moe_route(
            x, layer.router, layer.router_bias, moe.top_k, moe.norm_topk_prob, moe.softmax_after_topk,
            moe.routed_scaling_factor,
        )  # fmt: skip
        if not tied:
            return weights, experts
    return moe_route(F.linear(x, layer.router, layer.router_bias), moe, layer.router_correction_bias)


def has_cpu_router(layer: LlamaLayer, moe: MoeConfig) -> bool:
    """Whether cpu_ops.moe_route computes the layer's router: a float32 softmax one (not
    DeepSeek's sigmoid scores, groups or correction bias)."""
    return (
        moe.scoring == "softmax"
        and moe.num_groups <= 1
        and layer.router_correction_bias is None
        and layer.router.dtype == torch.float32
    )


def limit_to_groups(choice: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """DeepSeek's group-limited top-k: the experts as num_groups equal groups, each scored by the
    sum of its group_score_top best choice values (V2: its best, V3: its best two); the choice
    values of every expert outside the topk_groups best groups are dropped: to 0 after V2's
    softmax (as DeepseekV2TopkRouter), to -inf for V3 (whose biased values may be negative)."""
    groups = choice.view(choice.shape[0], moe.num_groups, -1)
    group_scores = groups.topk(moe.group_score_top, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, moe.topk_groups, dim=-1)[1]
    is_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    dropped = float("-inf") if moe.score_correction_bias else 0.0
    return groups.masked_fill(~is_kept.unsqueeze(-1), dropped).view_as(choice)


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> the expert's hidden


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts (GptOssExperts._apply_gate): the gate clamped above at `limit`, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate.clamp(max=limit)
    return (gate * torch.sigmoid(gate * alpha)).mul_(up.clamp(-limit, limit).add_(1))


def expert_glu(moe: MoeConfig, activation: Callable[[torch.Tensor], torch.Tensor]) -> Glu:
    """The gated activation of a mixture's experts: the model's activation(gate) * up, or the
    clamped SwiGLU where the config sets a limit."""
    if moe.swiglu_limit:
        return partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    return lambda gate, up: activation(gate).mul_(up)


def moe_mlp(
    x: torch.Tensor,
    layer: LlamaLayer,
    activation: Callable[[torch.Tensor], torch.Tensor],
    has_few_rows_linear: bool = False,
    fused_experts: Callable[..., torch.Tensor] | None = None,
    adds_down_bias: bool = True,
) -> torch.Tensor:
    """A sparse layer's MLP over x [T, H] (this rank's partial sum with tensor parallelism): the
    selected experts by the layer's `few_rows_moe` (router and experts in one call, for a step of
    few rows on the CPU, where LlamaModel.finish_loading bound one; whatever `has_few_rows_linear`
    says), `fused_experts` (the Triton backend's kernels/fused_moe.fused_moe_triton)
    or `grouped_experts`, plus Qwen2-MoE's shared expert, which every token runs, scaled by its
    own sigmoid gate (a function of the whole x, so each rank scales its partial sum alike)."""
    op_rows = len(x) <= cpu_ops.MOE_MAX_ROWS
    out = layer.few_rows_moe(x) if op_rows and layer.few_rows_moe is not None else None
    if out is None:
        out = routed_experts(x, layer, activation, has_few_rows_linear, fused_experts, adds_down_bias)
    if layer.shared_gate_up is not None:
        # Qwen2-MoE's gate scales the shared expert's output; DeepSeek's shared experts are ungated.
        scale = (
            None if layer.shared_expert_gate is None else torch.sigmoid(F.linear(x, layer.shared_expert_gate))
        )
        if op_rows and (layer.shared_quantized is not None or (has_few_rows_linear and activation is F.silu)):
            # Its weights read once for all the step's rows, as a routed expert's: every row's only
            # choice, weighted by its gate (or 1).
            every_row = torch.zeros(len(x), 1, dtype=torch.int64)
            row_weights = x.new_ones(len(x), 1) if scale is None else scale
            if layer.shared_quantized is not None:
                shared = layer.shared_quantized.mixture(x, row_weights, every_row)
            else:
                shared = float32_mixture(
                    x, layer.shared_gate_up[None], layer.shared_down[None], row_weights, every_row
                )
        else:
            linear = plain_linear(has_few_rows_linear, x)
            gate_up, down = layer.shared_expert_weights()
            gate, up = linear(x, gate_up).chunk(2, dim=-1)
            shared = linear(activation(gate).mul_(up), down)
            if scale is not None:
                shared.mul_(scale)
        out.add_(shared)
    return out


@dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class FewRowsMoe:
    """A sparse layer's router and routed experts as one C++ call (cpu_ops.moe_layer), its
    arguments bound once: what `route_experts` and `routed_experts` do for a step of few rows on
    the CPU, where the softmax router is float32 and one rank holds every expert (as GGUF blocks,
    or float32 with SiLU or gpt-oss's SwiGLU)."""

    arguments: tuple

    @classmethod
    def of(
        cls, layer: LlamaLayer, has_few_rows_linear: bool, is_silu: bool, adds_down_bias: bool = True
    ) -> FewRowsMoe | None:
        """The layer's one call, None where a step of few rows needs another path. With tensor
        parallelism (each rank's share of every expert) only the rank that `adds_down_bias`
        binds gpt-oss's down biases, as in `routed_experts`."""
        moe = layer.moe
        assert moe is not None
        if not (
            has_few_rows_linear and has_cpu_router(layer, moe) and layer.num_local_experts == moe.num_experts
        ):
            return None
        if layer.experts_quantized is not None:
            experts = layer.experts_quantized
            projections = zip((experts.gate, experts.up, experts.down), experts.formats, strict=True)
        elif is_silu or moe.swiglu_limit:
            inter = layer.experts_gate_up.shape[1] // 2
            gate_up = layer.experts_gate_up
            projections = ((gate_up[:, :inter], ""), (gate_up[:, inter:], ""), (layer.experts_down, ""))
        else:
            return None
        routing = (layer.router, layer.router_bias, moe.top_k, moe.norm_topk_prob, moe.softmax_after_topk,
                   moe.routed_scaling_factor)  # fmt: skip
        biases = (layer.experts_gate_up_bias, layer.experts_down_bias if adds_down_bias else None)
        swiglu = (moe.swiglu_alpha, moe.swiglu_limit) if moe.swiglu_limit else (0.0, 0.0)  # 0: SiLU
        return cls((*routing, *(part for projection in projections for part in projection), *biases, *swiglu))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's routed experts for x, or None where the router's choice is a tie that
        torch.topk breaks its own way (the caller routes with torch)."""
        out, tied = cpu_ops.moe_layer(x, *self.arguments)
        return None if tied else out


def routed_experts(
    x: torch.Tensor,
    layer: LlamaLayer,
    activation: Callable[[torch.Tensor], torch.Tensor],
    has_few_rows_linear: bool,
    fused_experts: Callable[..., torch.Tensor] | None,
    adds_down_bias: bool,
) -> torch.Tensor:
    """A sparse layer's routed experts over x, routed by `route_experts`. gpt-oss's experts' down
    biases are whole on every rank: only the partial sum of the rank that `adds_down_bias` (rank
    0) carries them; with expert parallelism each rank's experts' own.

    With expert parallelism the router picks among all experts and this rank weighs only the
    pairs of the experts it holds: the others' weights become 0 (their ids clamped into this
    rank's for the fused kernel, which then multiplies them by 0; the torch path skips them)."""
    moe = layer.moe
    assert moe is not None
    weights, experts = route_experts(x, layer, moe)
    num_local = layer.num_local_experts
    if num_local != moe.num_experts:
        local = experts - layer.expert_start
        is_here = (local >= 0) & (local < num_local)
        weights = weights * is_here
        # The torch path's sentinel (num_local: sorted last, never multiplied); the fused kernel's
        # clamp (a valid id of weight 0).
        experts = local.where(is_here, num_local) if fused_experts is None else local.clamp(0, num_local - 1)
    glu = expert_glu(moe, activation)
    down_bias = layer.experts_down_bias if adds_down_bias else None
    swiglu = (moe.swiglu_alpha, moe.swiglu_limit) if moe.swiglu_limit else None
    # Float32 experts take the fused op on the CPU path in its steps of few rows, for the gated
    # activations it has: SiLU (the model passes F.silu for it) and gpt-oss's SwiGLU.
    op_rows, is_silu = len(x) <= cpu_ops.MOE_MAX_ROWS, activation is F.silu
    if layer.experts_quantized is not None and op_rows:
        # One rank holds every expert here (`takes_quantized`), so it adds the down biases.
        out = layer.experts_quantized.mixture(
            x, weights, experts, layer.experts_gate_up_bias, down_bias, swiglu
        )
    elif has_few_rows_linear and op_rows and (is_silu or swiglu is not None) and num_local == moe.num_experts:
        # Each selected expert's rows read once (with expert parallelism, grouped_experts skips
        # the other ranks' pairs instead).
        out = float32_mixture(
            x, layer.experts_gate_up, layer.experts_down, weights, experts,
            gate_up_bias=layer.experts_gate_up_bias, down_bias=down_bias, swiglu=swiglu,
        )  # fmt: skip
    elif fused_experts is not None:
        out = fused_experts(
            x, layer.experts_gate_up, layer.experts_down, weights, experts, glu,
            gate_up_bias=layer.experts_gate_up_bias, down_bias=down_bias,
        )  # fmt: skip
    else:
        out = grouped_experts(x, layer, weights, experts, glu, has_few_rows_linear, down_bias)
    return out


def float32_mixture(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
    **options: torch.Tensor | tuple[float, float] | None,
) -> torch.Tensor:  # fmt: skip
    """cpu_ops.moe_experts on float32 experts: gate_up [E, 2I, H] (each expert's gate rows, then
    its up rows), down [E, H, I]; options: the op's gate_up_bias, down_bias and swiglu."""
    inter = gate_up.shape[1] // 2
    projections = ((gate_up[:, :inter], ""), (gate_up[:, inter:], ""), (down, ""))
    return cpu_ops.moe_experts(x, weights, experts, *projections, **options)


def plain_linear(has_few_rows_linear: bool, x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """F.linear of x by a plain [out, in] weight that no layout copies (a shared expert's, latent
    attention's): through the few-rows kernel where it takes x's rows."""
    return cpu_ops.few_rows_linear if has_few_rows_linear and len(x) <= cpu_ops.MAX_LINEAR_ROWS else F.linear


def grouped_experts(
    x: torch.Tensor,
    layer: LlamaLayer,
    weights: torch.Tensor,
    experts: torch.Tensor,
    glu: Glu,
    has_few_rows_linear: bool,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The selected experts' weighted outputs summed per token, in torch; with gpt-oss's biases,
    each expert's gate/up bias, and its down bias where given (`moe_mlp`).

    The step's (token, expert) pairs are sorted by expert, so each selected expert multiplies all
    of its tokens at once and its weights are read once per step, whatever the number of rows;
    experts no token chose are not read at all (nor, for experts kept as GGUF blocks, dequantized).
    With `has_few_rows_linear` (CPU float32 with the C++ kernels) an expert with at most
    cpu_ops.MAX_LINEAR_ROWS tokens multiplies through the few-rows linear, as a dense layer's
    weights do in such steps (torch's GEMV reads an [out, in] weight several times slower)."""
    top_k = experts.shape[1]
    flat_experts = experts.flatten()
    order = torch.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    pair_weights = weights.flatten()[order].to(x.dtype).unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    num_experts = layer.num_local_experts
    # Ids of num_experts (expert parallelism: another rank's experts, `moe_mlp`) sort last: not read.
    for expert, count in enumerate(
        torch.bincount(flat_experts, minlength=num_experts)[:num_experts].tolist()
    ):
        if count == 0:
            continue
        rows = token_of_pair[start : start + count]
        linear = (
            cpu_ops.few_rows_linear if has_few_rows_linear and count <= cpu_ops.MAX_LINEAR_ROWS else F.linear
        )
        gate_up_bias = None if layer.experts_gate_up_bias is None else layer.experts_gate_up_bias[expert]
        gate_up_weight, down_weight = layer.expert_weights(expert)
        gate, up = linear(x[rows], gate_up_weight, gate_up_bias).chunk(2, dim=-1)
        expert_out = linear(glu(gate, up), down_weight, None if down_bias is None else down_bias[expert])
        out.index_add_(0, rows, expert_out.mul_(pair_weights[start : start + count]))
        start += count
    return out


def few_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Blocks,
    bias: torch.Tensor | None = None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """F.linear for a step of at most cpu_ops.MAX_LINEAR_ROWS rows, from float32 or GGUF blocks
    (those against x quantized to 8 bits with int8_activations)."""
    if isinstance(weight, torch.Tensor):
        return cpu_ops.few_rows_linear(x, weight, bias)
    out = weight.multiply(x, int8_activations)
    return out if bias is None else out.add_(bias)


def int8_blocks_linear(
    x: torch.Tensor, weight: torch.Tensor | Blocks, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for a wider step with 8-bit activations: from the GGUF blocks where the weight
    has them (cpu_ops.linear_quantized_int8), else from its oneDNN copy."""
    if isinstance(weight, torch.Tensor):
        return onednn_linear(x, weight, bias)
    out = weight.multiply(x, int8_activations=True)
    return out if bias is None else out.add_(bias)


def linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear from the [in, out] copy of the weight (see TRANSPOSED_MAX_ROWS)."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] float32 weight reordered into oneDNN's blocked layout (see CAN_PREPACK)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through oneDNN, from a `prepack`ed weight or a plain [out, in] one. A bfloat16
    weight (WIDE_STEP_DTYPES) multiplies x rounded to bfloat16, accumulating in float32; oneDNN's
    output is bfloat16 then, widened back here, and the float32 bias is added after."""
    if weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "").to(x.dtype)
    return out if bias is None else out.add_(bias)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed in fp32 from half-precision operands, rounded back to x's dtype."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def paged_kv_cache(
    config: ModelConfig,
    num_kv_heads: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's two page tensors [num_blocks, block_size, heads, width]: K and V heads, or
    latent attention's latents and rope keys. Zeroed, so masked-out padding never reads NaN garbage."""
    mla = config.mla
    widths = (
        (mla.kv_lora_rank, mla.qk_rope_head_dim) if mla is not None else (num_kv_heads * config.head_dim,) * 2
    )
    heads = 1 if mla is not None else num_kv_heads
    shapes = [(num_blocks, block_size, heads, width // heads) for width in widths]
    return [
        tuple(huge_page_zeros(shape, dtype, device) for shape in shapes)  # type: ignore[misc]
        for _ in range(config.num_hidden_layers)
    ]


def kv_bytes_per_block(config: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of `paged_kv_cache` takes over all layers."""
    return config.num_hidden_layers * block_size * config.kv_cache_width(num_kv_heads) * dtype.itemsize
