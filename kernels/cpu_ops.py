"""The CPU path's C++ ops (cpu_ops.cpp): paged decode attention, the few-rows linear (from
float32 or GGUF-quantized weights, the latter also against 8-bit activations), the fused
residual add + RMSNorm, batched LoRA deltas, a whole decoder layer for decode steps of a few
sequences (with their LoRA deltas), and a mixture of experts' selected experts from their GGUF
or MXFP4 blocks (with the blocks' dequantization for wider steps); compiled on first use.

The host's C++ compiler builds them once per source, flags and torch version into
$BRIGADE_CACHE/kernels (default ~/.cache/brigade/kernels): about 30 s the first time, a
quarter of a second to load after. Each build writes a private file and renames it into place,
so concurrent workers never wait on each other's lock and a killed build leaves nothing half
written. Without a compiler or AVX2 + FMA the CPU path keeps its torch ops (gather + SDPA,
F.linear); `load()` logs why.

The source is built for an instruction set (ISAS): "avx2" (AVX2 + FMA + F16C), or "avx512"
(AVX-512 F/BW/VL/DQ with VNNI), whose kernels compute 16 floats a vector and whose 8-bit dot
products are VNNI's. `isa()` picks the widest one this CPU has; BRIGADE_CPU_ISA=avx2 asks for the
narrower one (an A/B, or a CPU whose AVX-512 is slower). Each build registers its ops under its
own namespace (torch.ops.brigade, torch.ops.brigade_avx512), so both can be loaded into one
process, which is how the tests hold each against the references.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # paged_decode's compiled head sizes
MAX_LINEAR_ROWS = 4  # few_rows_linear's
BUILD_TIMEOUT_S = 600
FLAGS = ("-shared", "-fPIC", "-std=c++20", "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")


@dataclass(frozen=True)
class Isa:
    """One build of cpu_ops.cpp: the compiler flags it adds, the /proc/cpuinfo flags a CPU needs to
    run it, and the torch.ops namespace its ops register under."""

    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    namespace: str


AVX2_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
ISAS = {
    "avx2": Isa((), AVX2_CPU_FLAGS, "brigade"),
    "avx512": Isa(
        (
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512vnni",
            "-DBRIGADE_OPS_NAMESPACE=brigade_avx512",
        ),
        AVX2_CPU_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
        "brigade_avx512",
    ),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's /proc/cpuinfo flags; where that cannot be read, AVX2's if torch's own check finds
    it (as before there were several builds), else none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return AVX2_CPU_FLAGS if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else frozenset()


def available_isas() -> list[str]:
    """The builds this CPU can run, narrowest first."""
    return [name for name, isa in ISAS.items() if isa.cpu_flags <= cpu_flags()]


@functools.cache
def isa() -> str:
    """The build the CPU path uses: BRIGADE_CPU_ISA if set, else the widest this CPU runs."""
    wanted = os.environ.get("BRIGADE_CPU_ISA", "")
    if wanted:
        if wanted not in ISAS:
            raise ValueError(f"BRIGADE_CPU_ISA={wanted!r}: expected one of {', '.join(ISAS)}")
        return wanted
    available = available_isas()
    return available[-1] if available else "avx2"


def _compile_command(output: Path, isa_name: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        os.environ.get("CXX", "c++"),
        str(SOURCE),
        *FLAGS,
        *ISAS[isa_name].flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{path}" for path in include_paths()),
        *(f"-L{path}" for path in library_paths()),
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def library_path(isa_name: str) -> Path:
    """Where the build for this source, these flags and this torch lives."""
    flags = " ".join((*FLAGS, *ISAS[isa_name].flags, torch.__version__))
    key = hashlib.sha256(SOURCE.read_bytes() + flags.encode()).hexdigest()[:16]
    root = Path(os.environ.get("BRIGADE_CACHE", Path.home() / ".cache" / "brigade"))
    return root / "kernels" / f"cpu_ops-{isa_name}-{key}.so"


def load() -> bool:
    """Build (or find the build of) the ops for `isa()` and load them; False, logged, where they cannot be."""
    return load_isa(isa())


@functools.cache
def load_isa(isa_name: str) -> bool:
    """load() for one build: False, logged, where the CPU lacks its instructions or it cannot be built."""
    missing = ISAS[isa_name].cpu_flags - cpu_flags()
    if missing or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("cpu_ops: this CPU lacks %s for the %s kernels; the CPU path keeps its torch ops",
                 ", ".join(sorted(missing)) or "AVX2", isa_name)  # fmt: skip
        return False
    path = library_path(isa_name)
    try:
        if not path.exists():
            log.info("cpu_ops: compiling the %s CPU kernels once (about 30 s) into %s", isa_name, path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
            os.close(fd)
            try:
                subprocess.run(
                    _compile_command(Path(tmp), isa_name),
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        detail = exc.stderr[-2000:] if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("cpu_ops: not available (%s); the CPU path keeps its torch ops", detail)
        return False
    return True


def ops():
    """The loaded ops of the build the CPU path uses (torch.ops.brigade or torch.ops.brigade_avx512)."""
    return getattr(torch.ops, ISAS[isa()].namespace)


def has_paged_decode(head_dim: int, dtype: torch.dtype) -> bool:
    """paged_decode for a model in `dtype` (float32; its caches float32 or bfloat16)."""
    return dtype == torch.float32 and head_dim in HEAD_DIMS and load()


def has_kernels(dtype: torch.dtype) -> bool:
    """The ops for float32 tensors of any shape: few_rows_linear(_quantized), add_rms_norm,
    logsumexp_argmax, moe_route, moe_layer."""
    return dtype == torch.float32 and load()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) over its context in the caches [N, block_size, Hk, D]
    (float32, or bfloat16 read widened: engine.kv_cache_dtype):
    block_tables [S, max_blocks] and seq_lens [S] (int64 avoids a conversion per call) -> [S, Hq, D].
    sinks [Hq]: each query head's sink logit in the softmax denominator (gpt-oss), None without."""
    return ops().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sinks)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x of at most MAX_LINEAR_ROWS rows, from the [out, in] weight read once."""
    return ops().few_rows_linear(x, weight, bias)


# The GGUF block formats few_rows_linear_quantized reads: bytes of a block of BLOCK_WEIGHTS (Q4_1,
# Q8_0, MXFP4) or of a K-quant super-block of SUPER_BLOCK_WEIGHTS, as the file stores them.
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "MXFP4": 17}
# The formats of a dense weight's blocks (the few-rows linear and linear_quantized_int8 alike).
QUANTIZED_FORMATS = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The formats of experts' blocks (moe_experts, dequantize_blocks): those, and MXFP4, in
# which gpt-oss's checkpoints ship their experts (and llama.cpp's MXFP4_MOE files any MoE's); it
# has no 8-bit activation kernel, which no expert takes.
EXPERT_FORMATS = (*QUANTIZED_FORMATS, "MXFP4")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # read as the file has them (`to_lanes` leaves them be)
BLOCK_WEIGHTS = 32
SUPER_BLOCK_WEIGHTS = 256
# Bytes a block takes in a row that `to_lanes` packed: float32 scales (and Q4_1's minimums).
PACKED_BLOCK_BYTES = BLOCK_BYTES | {"Q4_1": 24, "Q8_0": 36, "MXFP4": 20}


def _lane_order() -> tuple[np.ndarray, np.ndarray]:
    """For weight k = 8 v + i of a block: its 32-bit word (i % 4) and its position (2 v + i / 4)
    in the layout the kernel reads (see cpu_ops.cpp)."""
    k = np.arange(BLOCK_WEIGHTS)
    v, i = k // 8, k % 8
    return i % 4, 2 * v + i // 4


def _nibble_order() -> tuple[np.ndarray, np.ndarray]:
    """For byte b of a packed 4-bit block: the weights k whose nibbles it holds, low and high (the
    byte of weight k is 4 word + position / 2, its nibble position % 2: `_lane_order`)."""
    word, position = _lane_order()
    order = np.empty((2, BLOCK_WEIGHTS // 2), dtype=np.intp)
    order[position % 2, 4 * word + position // 2] = np.arange(BLOCK_WEIGHTS)
    return order[0], order[1]


def mxfp4_half_scales(exponents: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 exponents e (uint8) -> 2^(e - 128) in float32, half of each block's scale
    (ggml's e8m0_to_fp32_half): the kernels' values are the E2M1 values doubled (cpu_ops.cpp,
    BlockMXFP4), and 2^(e - 128) is finite for every e, subnormal for e < 2."""
    e = exponents.astype(np.uint32)
    # (e - 1 wraps around where e is 0: np.where takes the other branch there.)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An MXFP4 weight as gpt-oss's checkpoints store it, blocks [..., G, 16] uint8 (values 2j and
    2j + 1 in byte j's low and high nibble) and scales [..., G] uint8 (E8M0 exponents), as GGUF
    MXFP4 rows [..., G * 17], what `to_lanes` takes: each block its exponent, then 16 bytes with
    values j and j + 16 in byte j's low and high nibble."""
    codes = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], BLOCK_WEIGHTS)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    rows = np.concatenate((scales[..., None], packed), axis=-1)
    return rows.reshape(*rows.shape[:-2], -1)


def to_lanes(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF blocks [rows, bytes] (uint8) packed as the kernels read them (cpu_ops.cpp, BlockQ4_1):
    each block's float16 scale (MXFP4: half its E8M0 scale, `mxfp4_half_scales`) widened to
    float32 in front of its quants, the quants reordered, and Q4_1's minimums, float32, moved to
    the end of their row. Every weight keeps its value (a float16 or a power of two is exact in
    float32). K-quants stay as they are."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: expected one of {EXPERT_FORMATS}")
    if fmt in K_QUANTS:
        return blocks
    num_rows = blocks.shape[0]
    grouped = blocks.reshape(num_rows, -1, BLOCK_BYTES[fmt])
    num_blocks = grouped.shape[1]
    if fmt == "MXFP4":
        scales = mxfp4_half_scales(grouped[:, :, 0])
    else:
        halves = np.ascontiguousarray(grouped[:, :, : 4 if fmt == "Q4_1" else 2]).view(np.float16)
        scales = halves[..., 0].astype(np.float32)
    quants = grouped[:, :, -32:] if fmt == "Q8_0" else grouped[:, :, -16:]
    if fmt in ("Q4_1", "MXFP4"):
        # GGUF: weight k < 16 is the low nibble of byte k, weight k >= 16 the high nibble of byte k - 16.
        values = np.concatenate((quants & 0x0F, quants >> 4), axis=-1)
        low, high = _nibble_order()
        reordered = values[..., low] | (values[..., high] << 4)
    else:  # Q8_0
        word, position = _lane_order()
        half = position // 4  # vectors 0-1 read the first 16 bytes, 2-3 the second
        target = 16 * half + 4 * word + position % 4
        reordered = np.empty_like(quants)
        reordered[..., target] = quants
    packed = np.concatenate([scales[..., None].view(np.uint8), reordered], axis=2).reshape(num_rows, -1)
    if fmt == "Q4_1":
        minimums = halves[..., 1].astype(np.float32).view(np.uint8).reshape(num_rows, 4 * num_blocks)
        packed = np.concatenate([packed, minimums], axis=1)
    return packed


def few_rows_linear_quantized(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """F.linear for x of at most MAX_LINEAR_ROWS rows from weights in a GGUF block format:
    blocks [out, in / 32 * PACKED_BLOCK_BYTES] uint8, each row its GGUF blocks packed by `to_lanes`."""
    return ops().few_rows_linear_quantized(x, blocks, fmt)


# The most rows a step's mixture of experts multiplies in one op (moe_experts) from the experts'
# GGUF blocks or float32 rows; wider steps (prefills) run each selected expert as a GEMM (its
# blocks dequantized first).
MOE_MAX_ROWS = 16


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate: tuple[torch.Tensor, str],
    up: tuple[torch.Tensor, str],
    down: tuple[torch.Tensor, str],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
) -> torch.Tensor:
    """A MoE layer's selected experts for x [T, H]: sum over each row's k choices of
    weights[t, j] * down(SiLU(gate(x_t)) * up(x_t)) of expert experts[t, j] (weights float32,
    experts int64, [T, k]). gate, up: (blocks [E, I, bytes] uint8, format), down: ([E, H, bytes],
    format), each expert's rows packed by `to_lanes`; or a projection in float32, (weight [E, out,
    in], ""), each expert's rows contiguous (gate and up may be views of one [E, 2I, H]). The pairs
    are grouped by expert, so each selected expert's weights are read once per step, however many
    rows chose it.

    gpt-oss's experts: gate_up_bias [E, 2I] (each expert's gate columns, then its up columns)
    added to gate(x) and up(x), down_bias [E, H] to down(...) before the routing weight scales it,
    and swiglu = (alpha, limit) for its clamped SwiGLU (model.clamped_swiglu) in place of SiLU;
    float32, None for none."""
    alpha, limit = swiglu if swiglu is not None else (0.0, 0.0)
    return ops().moe_experts(x, weights, experts, *gate, *up, *down, gate_up_bias, down_bias, alpha, limit)


def dequantize_blocks(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 weight [rows, in] of GGUF blocks [rows, bytes] as few_rows_linear_quantized
    reads them (packed by `to_lanes`, any of EXPERT_FORMATS): the values its kernels multiply by."""
    return ops().dequantize_blocks(blocks, fmt)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), residual None meaning none, in one pass."""
    return ops().add_rms_norm(x, weight, eps, residual)


def logsumexp_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, V] float32 -> (each row's log-sum-exp [S] float32, its first largest entry's index
    [S] int64), as torch.logsumexp and torch.argmax give them, in two reads of each row."""
    return ops().logsumexp_argmax(x)


def moe_route(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    normalize: bool,
    softmax_after_topk: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A softmax router's (weights [T, k] float32, experts [T, k] int64, tied) for x [T, H] and
    router [E, H] (+ bias [E]), in one call: model.moe_route's softmax scoring on x @ router^T, the
    top k in descending order, renormalized where `normalize`, times `scaling`; or gpt-oss's
    softmax over the top k logits (`softmax_after_topk`, unscaled). `tied`: a row's k-th score equals one left out,
    which torch.topk (and so HF) breaks in an order of its own, or a score is NaN: route such a
    step with torch. For
    few rows: it runs on the calling thread."""
    return ops().moe_route(x, router, bias, top_k, normalize, softmax_after_topk, scaling)


def moe_layer(x: torch.Tensor, *layer: object) -> tuple[torch.Tensor, bool]:
    """A sparse layer for x [T, H] of few rows in one call: moe_route, then moe_experts on its
    choice. `layer`: moe_route's arguments after x (router, bias, top_k, normalize,
    softmax_after_topk, scaling), then moe_experts' after the routing (gate, its format, up, its
    format, down, its format, gate_up_bias, down_bias, swiglu alpha, swiglu limit: 0 for SiLU),
    as model.FewRowsMoe binds them once. -> (the layer's output, tied): where moe_route reports a
    tie the output is empty, and the caller routes the step with torch."""
    return ops().moe_layer(x, *layer)


class DecodeLayers(NamedTuple):
    """A model's decoder layers as few_rows_decode_layers takes them, flattened in layer order:
    two norms a layer (input, post-attention); the parts of each layer's four weights (QKV, O,
    gate_up, down: a tensor each, float32 [out, in] with format "" or GGUF blocks with theirs) and
    how many each weight has; a QKV bias or None a layer."""

    norms: list[torch.Tensor]
    weights: list[torch.Tensor]
    formats: list[str]
    parts_per_weight: list[int]
    qkv_biases: list[torch.Tensor | None]


NO_LORA = ([], [], None, None, None)  # few_rows_decode_layers' `lora` for a step without adapters


def few_rows_decode_layers(
    hidden: torch.Tensor,
    layers: DecodeLayers,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: tuple[list[torch.Tensor], list[torch.Tensor]],
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    scale: float,
    int8_activations: bool = False,
    lora: tuple = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of an all-decode step of at most MAX_LINEAR_ROWS tokens, in one call
    (the layers' small ops chained in C++): (the last layer's output, the residual stream).
    cos / sin: [T, D] signed full-width rotary rows; kv_caches: (K caches, V caches), one a layer,
    all float32 or all bfloat16 (stored rounded to nearest even, read widened);
    slots, block_tables, seq_lens: int64. int8_activations: the GGUF blocks multiply by
    linear_quantized_int8. lora: the step's adapter deltas, A and B of q, k, v, o, gate, up, down
    in that order, each every layer's ([layers, slots, max_rank, features]), their ranks [layers,
    7, slots], and the rows and segments `lora_add` takes: (a, b, ranks, rows, segments); () for
    none."""
    return ops().few_rows_decode_layers(
        hidden, *layers, eps, cos, sin, *kv_caches, slots, block_tables, seq_lens, num_heads, scale,
        int8_activations, *(lora or NO_LORA),
    )  # fmt: skip


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    ranks: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
) -> None:
    """kernels/lora.py's batched LoRA deltas (its contract, `lora_add_ref` the reference) in
    float32, in place into out: each segment's slot's A and B read once for all of its rows."""
    ops().lora_add(out, x, a, b, ranks, rows, segments)


def linear_quantized_int8(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """x @ W^T for x of any number of rows from GGUF blocks (as few_rows_linear_quantized reads
    them), with x quantized to 8 bits first, as llama.cpp does: each row in blocks of 32 values,
    q = rint(x * (1 / d)) with d = max|x| / 127 (float32), then integer dot products with the weight
    quants and float scales. Not the float32 result: the activations are rounded
    (engine.cpu_int8_activations opts in)."""
    return ops().linear_quantized_int8(x, blocks, fmt)
